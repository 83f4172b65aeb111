import pytest
from numeric.bounds import clamp, clamp_all


@pytest.mark.parametrize("x, lo, hi, want", [(-1, 2, 3, 2), (1.5, 2.5, 9, 2.5), (4, 2, 3, 3),
                                             (2, 2, 2, 2), (-100, -7, -3, -7)])
def test_clamp(x, lo, hi, want):
    assert clamp(x, lo, hi) == want


def test_clamp_all():
    assert clamp_all([-3, 0, 4, 11], 0, 10) == [0, 0, 4, 10]


def test_bad_range():
    with pytest.raises(ValueError):
        clamp(1, 3, 2)
