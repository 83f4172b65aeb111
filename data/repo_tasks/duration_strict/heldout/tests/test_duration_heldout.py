import pytest
from timefmt.duration import parse_duration


@pytest.mark.parametrize("text, want", [("1h30m", 5400), ("2h", 7200), ("1h5m10s", 3910),
                                        ("10s", 10), (" 3m ", 180), ("0s", 0)])
def test_valid(text, want):
    assert parse_duration(text) == want


@pytest.mark.parametrize("text", ["   ", "1h1h", "1s1h", "30m1h", "10", "h", "1x", "2h 5m"])
def test_invalid(text):
    with pytest.raises(ValueError):
        parse_duration(text)
