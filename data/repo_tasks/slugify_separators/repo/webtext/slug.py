"""URL slugs."""
import re


def slugify(title):
    """A URL slug: lower-case ASCII letters and digits, words joined by single dashes."""
    words = re.split(r"[^a-z0-9]", title.lower())
    return "-".join(words)
