from textkit.lines import line_range
from textkit.numbering import excerpt, number_lines

TEXT = "one\ntwo\nthree\nfour"


def test_a_single_line():
    assert line_range(TEXT, 3, 3) == ["three"]


def test_all_lines():
    assert line_range(TEXT, 1, 4) == TEXT.splitlines()


def test_numbering_from_ten():
    assert number_lines("a\nb", start=10) == ["10: a", "11: b"]


def test_excerpt_keeps_the_numbers():
    assert excerpt(TEXT, 2, 3) == ["2: two", "3: three"]
