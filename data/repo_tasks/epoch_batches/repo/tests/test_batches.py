from loader.batches import Batcher


def test_two_epochs():
    b = Batcher(range(5), 2)
    assert list(b.batches()) == [[0, 1], [2, 3], [4]]
    assert list(b.batches()) == [[0, 1], [2, 3], [4]]
