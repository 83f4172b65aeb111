from notes.tags import add_tag


def test_calls_do_not_share_a_list():
    assert add_tag("a") == ["a"]
    assert add_tag("b") == ["b"]
