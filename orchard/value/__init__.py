"""orchard.value."""
