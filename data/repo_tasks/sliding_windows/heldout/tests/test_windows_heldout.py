import pytest
from seqtools.windows import pairwise_diffs, windows


def test_one_window_as_long_as_the_sequence():
    assert windows("abcd", 4) == [("a", "b", "c", "d")]


def test_windows_longer_than_the_sequence():
    assert windows([1, 2], 3) == []


def test_windows_of_one():
    assert windows([5, 6], 1) == [(5,), (6,)]


@pytest.mark.parametrize("k", [1, 2, 3, 7, 10])
def test_window_count(k):
    assert len(windows(list(range(10)), k)) == 11 - k


def test_pairwise_diffs():
    assert pairwise_diffs([1, 4, 9, 16]) == [3, 5, 7]
