"""Binary search for insertion points."""


def insert_position(xs, x):
    """Where `x` goes in the sorted list `xs` to keep it sorted (after any items equal to x)."""
    lo, hi = 0, len(xs) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def insert(xs, x):
    """A new sorted list: `xs` with `x` inserted."""
    i = insert_position(xs, x)
    return xs[:i] + [x] + xs[i:]
