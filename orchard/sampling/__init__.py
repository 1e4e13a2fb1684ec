"""orchard.sampling."""
