from fsnames.prefix import drop_prefix
from fsnames.suffix import drop_extension


def test_extension():
    assert drop_extension("test.txt", ".txt") == "test"


def test_prefix():
    assert drop_prefix("tmp_temp.log", "tmp_") == "temp.log"
