"""orchard.rewards."""
