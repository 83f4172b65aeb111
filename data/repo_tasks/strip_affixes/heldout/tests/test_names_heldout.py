import pytest
from fsnames import base_name
from fsnames.prefix import drop_prefix
from fsnames.suffix import drop_extension


@pytest.mark.parametrize("name, ext, want", [("notes.txt.txt", ".txt", "notes.txt"),
                                             ("text", ".txt", "text"), ("a.tar", ".gz", "a.tar"),
                                             ("x.py", ".py", "x")])
def test_drop_extension(name, ext, want):
    assert drop_extension(name, ext) == want


@pytest.mark.parametrize("name, prefix, want", [("pre_pre_x", "pre_", "pre_x"),
                                                ("other", "tmp_", "other"), ("ab", "ab", "")])
def test_drop_prefix(name, prefix, want):
    assert drop_prefix(name, prefix) == want


def test_base_name():
    assert base_name("log_latest.log", "log_", ".log") == "latest"
