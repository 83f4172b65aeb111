from sortedlist.search import insert, insert_position


def test_position_past_the_end():
    assert insert_position([1, 3, 5], 6) == 3


def test_insert_in_the_middle():
    assert insert([1, 3, 5], 4) == [1, 3, 4, 5]
