import functools
import random

from versions.compare import compare, newest


def test_equal_with_missing_parts():
    assert compare("1.0", "1") == 0 and compare("1.2.0", "1.2") == 0


def test_older():
    assert compare("0.9.9", "1.0") == -1
    assert compare("1.2.3", "1.2.4") == -1


def test_newest():
    assert newest(["1.2", "1.10", "1.9.9"]) == "1.10"


def test_sorting_agrees_with_tuples():
    rng = random.Random(1)
    vs = [".".join(str(rng.randrange(12)) for _ in range(3)) for _ in range(40)]
    got = sorted(vs, key=functools.cmp_to_key(compare))
    assert [tuple(map(int, v.split("."))) for v in got] == sorted(
        tuple(map(int, v.split("."))) for v in vs)
