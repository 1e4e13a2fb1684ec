"""orchard.losses."""
