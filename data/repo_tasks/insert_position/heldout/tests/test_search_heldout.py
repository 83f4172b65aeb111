import bisect
import random

from sortedlist.search import insert, insert_position


def test_equal_items_go_after():
    assert insert_position([1, 2, 2, 2, 3], 2) == 4


def test_empty_and_single():
    assert insert_position([], 5) == 0
    assert insert_position([5], 5) == 1
    assert insert_position([5], 9) == 1


def test_against_bisect_right():
    rng = random.Random(0)
    for _ in range(300):
        xs = sorted(rng.randrange(10) for _ in range(rng.randrange(8)))
        x = rng.randrange(-1, 11)
        assert insert_position(xs, x) == bisect.bisect_right(xs, x), (xs, x)
        assert insert(xs, x) == sorted(xs + [x])
