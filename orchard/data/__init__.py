"""orchard.data."""
