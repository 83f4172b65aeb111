from textkit.lines import line_range
from textkit.numbering import number_lines


def test_first_two_lines():
    assert line_range("a\nb\nc", 1, 2) == ["a", "b"]


def test_numbering_starts_at_one():
    assert number_lines("x\ny") == ["1: x", "2: y"]
