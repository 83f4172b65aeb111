"""Leap years and month lengths (Gregorian calendar)."""

MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_leap(year):
    """Every 4th year is a leap year, except centuries, except every 4th century."""
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return True
    return year % 4 == 0


def days_in_month(year, month):
    """Days in `month` (1-12) of `year`."""
    if month == 2 and is_leap(year):
        return 29
    return MONTH_DAYS[month - 1]


def days_in_year(year):
    return sum(days_in_month(year, m) for m in range(1, 13))
