"""orchard.rollout."""
