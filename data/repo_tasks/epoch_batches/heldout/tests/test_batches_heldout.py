from loader.batches import Batcher


def test_three_epochs_from_a_generator():
    b = Batcher((x * x for x in range(4)), 3)
    for _ in range(3):
        assert list(b.batches()) == [[0, 1, 4], [9]]


def test_exact_batches():
    b = Batcher("abcdef", 2)
    assert list(b.batches()) == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert sum(len(x) for x in b.batches()) == 6


def test_empty():
    assert list(Batcher([], 4).batches()) == []
