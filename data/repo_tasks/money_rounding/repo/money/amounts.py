"""Rounding amounts to cents."""
from decimal import Decimal


def to_cents(amount):
    """`amount` (a string like '2.675', or a Decimal) rounded half up to whole cents, as a
    string with two decimals."""
    return f"{round(float(amount), 2):.2f}"


def total(amounts):
    """The exact sum of `amounts`, rounded like `to_cents`."""
    return to_cents(sum((Decimal(str(a)) for a in amounts), Decimal(0)))
