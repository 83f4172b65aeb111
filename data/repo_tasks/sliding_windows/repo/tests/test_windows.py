from seqtools.windows import windows


def test_windows_of_two():
    assert windows([1, 2, 3], 2) == [(1, 2), (2, 3)]
