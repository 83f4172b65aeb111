"""Selecting lines of a text."""


def line_range(text, first, last):
    """Lines `first` to `last` of `text` (1-based, both included)."""
    lines = text.splitlines()
    return lines[first:last]
