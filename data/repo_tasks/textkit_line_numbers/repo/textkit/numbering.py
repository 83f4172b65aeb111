"""Numbered lines."""
from textkit.lines import line_range


def number_lines(text, start=1):
    """Each line of `text` prefixed with its number, counting from `start`: '1: first'."""
    return [f"{n}: {line}" for n, line in enumerate(text.splitlines())]


def excerpt(text, first, last):
    """Lines `first`..`last`, numbered as they are numbered in the whole text."""
    return [f"{n}: {line}" for n, line in zip(range(first, last + 1),
                                                line_range(text, first, last))]
