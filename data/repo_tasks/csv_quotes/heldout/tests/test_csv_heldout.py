import pytest
from minicsv.reader import parse_row
from minicsv.writer import format_field, format_row


def test_parse_doubled_quotes():
    assert parse_row('"a""b",c') == ['a"b', "c"]
    assert parse_row('"""",x') == ['"', "x"]


@pytest.mark.parametrize("row", [["plain", "two words"], ['""', ","], ["", "", "x"],
                                 ['he said "no", then "yes"', "1"], ['"', '"x"', 'a""b']])
def test_round_trips(row):
    assert parse_row(format_row(row)) == row


def test_plain_fields_stay_bare():
    assert format_field("plain") == "plain" and format_field(3) == "3"
