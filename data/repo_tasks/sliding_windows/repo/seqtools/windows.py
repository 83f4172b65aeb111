"""Sliding windows over a sequence."""


def windows(seq, size):
    """Every run of `size` consecutive items of `seq`, in order, as tuples."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [tuple(seq[i:i + size]) for i in range(len(seq) - size)]


def pairwise_diffs(seq):
    """Differences of neighbouring items: [b - a for each neighbouring pair a, b]."""
    return [b - a for a, b in windows(seq, 2)]
