import calendar

import pytest
from calendar_utils.leap import days_in_month, days_in_year, is_leap


@pytest.mark.parametrize("year", [1600, 1700, 1800, 2000, 2023, 2024, 2100, 2400])
def test_against_the_standard_library(year):
    assert is_leap(year) == calendar.isleap(year)


def test_month_lengths():
    for year in (1900, 2000, 2100):
        for month in range(1, 13):
            assert days_in_month(year, month) == calendar.monthrange(year, month)[1]


def test_days_in_year():
    assert days_in_year(2100) == 365 and days_in_year(2000) == 366
