"""File-name helpers."""
from fsnames.prefix import drop_prefix
from fsnames.suffix import drop_extension


def base_name(name, prefix, ext):
    """`name` without `prefix` and without the extension `ext`."""
    return drop_extension(drop_prefix(name, prefix), ext)
