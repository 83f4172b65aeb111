"""Lines of text, numbered from 1."""
