from notes.tags import Note, add_tag


def test_a_given_list_is_extended_in_place():
    tags = ["x"]
    assert add_tag("y", tags) is tags and tags == ["x", "y"]
    assert add_tag("x", tags) == ["x", "y"]


def test_many_default_calls():
    assert [add_tag(t) for t in "pqr"] == [["p"], ["q"], ["r"]]


def test_notes_have_their_own_tags():
    a, b = Note("first"), Note("second")
    a.tag("todo")
    assert a.tags == ["note", "todo"] and b.tags == ["note"]
