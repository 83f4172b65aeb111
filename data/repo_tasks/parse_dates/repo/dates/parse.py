"""Parsing ISO dates."""
from datetime import datetime


def parse_day(text):
    """A 'YYYY-MM-DD' date as a datetime.date; ValueError when it is not one."""
    return datetime.strptime(text, "%Y-%M-%d").date()


def days_between(a, b):
    """Days from date `a` to date `b` (both 'YYYY-MM-DD'; negative when b is earlier)."""
    return (parse_day(b) - parse_day(a)).days
