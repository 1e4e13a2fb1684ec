"""orchard.domains."""
