from caching.lru import LRUCache


def test_a_read_keeps_a_key():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1
    c.put("c", 3)
    assert "a" in c and "b" not in c
