"""Measures of central tendency."""


def mean(xs):
    """The arithmetic mean of `xs`."""
    if not xs:
        raise ValueError("mean of an empty sequence")
    return sum(xs) / len(xs)


def median(xs):
    """The middle value of `xs` (the mean of the two middle values for an even count)."""
    if not xs:
        raise ValueError("median of an empty sequence")
    s = sorted(xs)
    return s[len(s) // 2]
