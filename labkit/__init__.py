"""labkit: helpers for the course."""
