import pytest
from timefmt.duration import parse_duration


def test_minutes():
    assert parse_duration("45m") == 2700


def test_empty_is_an_error():
    with pytest.raises(ValueError):
        parse_duration("")


def test_repeated_unit_is_an_error():
    with pytest.raises(ValueError):
        parse_duration("5m5m")
