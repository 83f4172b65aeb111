"""Durations written like '1h30m'."""
import re

_PART = re.compile(r"(\d+)([hms])")
UNITS = {"h": 3600, "m": 60, "s": 1}


def parse_duration(text):
    """Seconds in a duration like '1h30m', '45s' or '2h5m10s': one or more parts, the units in
    the order h, m, s, each at most once. ValueError on anything else."""
    text = text.strip()
    parts = _PART.findall(text)
    if "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * UNITS[u] for n, u in parts)
