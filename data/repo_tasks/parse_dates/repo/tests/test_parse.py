from dates.parse import parse_day


def test_the_month_is_read():
    assert parse_day("2024-03-05").month == 3
