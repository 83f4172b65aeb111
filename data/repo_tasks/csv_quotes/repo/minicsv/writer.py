"""Writing CSV lines."""


def format_field(value):
    """One CSV field: quoted when it holds a comma, a double quote or a newline."""
    text = str(value)
    if any(c in text for c in ',"\n'):
        return '"' + text + '"'
    return text


def format_row(values):
    return ",".join(format_field(v) for v in values)
