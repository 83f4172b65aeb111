import random
import statistics

import pytest
from stats.central import median


@pytest.mark.parametrize("xs, want", [([4, 1, 3, 2], 2.5), ([1, 1], 1), ([5], 5),
                                      ([1, 2, 3, 4, 5, 6], 3.5), ([-2, 2], 0)])
def test_median(xs, want):
    assert median(xs) == want


def test_against_the_standard_library():
    rng = random.Random(2)
    for n in range(1, 30):
        xs = [rng.randrange(-50, 50) for _ in range(n)]
        assert median(xs) == statistics.median(xs)


def test_empty():
    with pytest.raises(ValueError):
        median([])
