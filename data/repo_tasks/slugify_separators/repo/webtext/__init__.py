"""Text for the web."""
