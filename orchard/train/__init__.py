"""orchard.train."""
