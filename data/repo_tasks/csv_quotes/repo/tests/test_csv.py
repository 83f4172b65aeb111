from minicsv.reader import parse_row
from minicsv.writer import format_row


def test_quote_is_doubled():
    assert format_row(['a"b']) == '"a""b"'


def test_round_trip_with_a_quote():
    row = ['say "hi"', "x"]
    assert parse_row(format_row(row)) == row
