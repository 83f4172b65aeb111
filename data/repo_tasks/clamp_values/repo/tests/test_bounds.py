from numeric.bounds import clamp


def test_below_the_range():
    assert clamp(-5, 0, 10) == 0


def test_inside_the_range():
    assert clamp(5, 0, 10) == 5
