import datetime

import pytest
from dates.parse import days_between, parse_day


def test_whole_dates():
    assert parse_day("1999-12-31") == datetime.date(1999, 12, 31)
    assert parse_day("2024-02-29") == datetime.date(2024, 2, 29)


def test_days_between():
    assert days_between("2024-01-31", "2024-03-01") == 30
    assert days_between("2023-03-01", "2023-01-31") == -29


@pytest.mark.parametrize("bad", ["2024-13-01", "2023-02-29", "2024/01/01"])
def test_not_a_date(bad):
    with pytest.raises(ValueError):
        parse_day(bad)
