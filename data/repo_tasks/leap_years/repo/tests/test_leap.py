from calendar_utils.leap import days_in_month, is_leap


def test_1900_is_not_leap():
    assert is_leap(1900) is False


def test_february_2024():
    assert days_in_month(2024, 2) == 29
