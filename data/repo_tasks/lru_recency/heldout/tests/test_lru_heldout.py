import random

from caching.lru import LRUCache


def test_against_a_model():
    rng = random.Random(3)
    for capacity in (1, 2, 3, 5):
        cache, order, values = LRUCache(capacity), [], {}
        for _ in range(400):
            key = rng.randrange(8)
            if rng.random() < 0.5:
                got = cache.get(key)
                assert got == values.get(key)
                if key in values:
                    order.remove(key)
                    order.append(key)
            else:
                cache.put(key, key * 10)
                if key in values:
                    order.remove(key)
                order.append(key)
                values[key] = key * 10
                if len(order) > capacity:
                    del values[order.pop(0)]
            assert len(cache) == len(values)
            assert all(k in cache for k in values)


def test_missing_key_default():
    assert LRUCache(1).get("x", 7) == 7
