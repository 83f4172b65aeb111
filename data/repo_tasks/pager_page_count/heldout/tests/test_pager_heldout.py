import pytest
from pager import page, page_count


@pytest.mark.parametrize("n, per, want", [(0, 3, 0), (1, 3, 1), (3, 3, 1), (9, 3, 3),
                                          (100, 7, 15), (6, 1, 6)])
def test_page_count(n, per, want):
    assert page_count(n, per) == want


def test_page_count_matches_the_pages():
    for n in range(0, 25):
        for per in range(1, 6):
            items = list(range(n))
            pages = page_count(n, per)
            assert all(page(items, k, per) for k in range(1, pages + 1))
            assert page(items, pages + 1, per) == []


def test_bad_page_size():
    with pytest.raises(ValueError):
        page_count(3, 0)
