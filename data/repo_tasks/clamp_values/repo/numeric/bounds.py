"""Keeping values inside a range."""


def clamp(x, lo, hi):
    """`x` limited to the closed range [lo, hi]."""
    if lo > hi:
        raise ValueError("lo must not exceed hi")
    if x < lo:
        return hi
    if x > hi:
        return hi
    return x


def clamp_all(xs, lo, hi):
    return [clamp(x, lo, hi) for x in xs]
