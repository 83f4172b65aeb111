"""Finding e-mail addresses in text."""
import re

EMAIL = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


def first_email(text):
    """The first e-mail address anywhere in `text`, or None."""
    m = EMAIL.match(text)
    return m.group(0) if m else None


def all_emails(text):
    """Every e-mail address in `text`, in order."""
    return EMAIL.findall(text)
