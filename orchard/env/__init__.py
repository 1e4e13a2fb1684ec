"""orchard.env."""
