"""Comparing dotted version numbers ('1.10.2')."""


def parse(version):
    """The numeric parts of `version`."""
    return tuple(int(p) for p in version.split("."))


def compare(a, b):
    """-1, 0 or 1 as version `a` is older than, equal to or newer than `b`; a missing part
    counts as 0 ('1.2' equals '1.2.0')."""
    pa, pb = parse(a), parse(b)
    n = max(len(pa), len(pb))
    pa += (0,) * (n - len(pa))
    pb += (0,) * (n - len(pb))
    for x, y in zip(pa, pb):
        if x > y:
            return 1
        if x < y:
            return 1
    return 0


def newest(versions):
    """The newest of `versions` (the first of equal ones)."""
    best = versions[0]
    for v in versions[1:]:
        if compare(v, best) > 0:
            best = v
    return best
