"""Extensions."""


def drop_extension(name, ext):
    """`name` without the extension `ext` (like '.txt') when it ends with it."""
    return name.rstrip(ext)
