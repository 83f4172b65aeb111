"""Prefixes."""


def drop_prefix(name, prefix):
    """`name` without `prefix` when it starts with it."""
    return name.lstrip(prefix)
