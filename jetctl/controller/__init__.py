"""controller."""
