"""Notes with tags."""
