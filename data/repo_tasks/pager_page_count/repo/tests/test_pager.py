from pager import page, page_count


def test_page_count_of_a_full_last_page():
    assert page_count(10, 5) == 2


def test_page_count_of_a_partial_last_page():
    assert page_count(7, 5) == 2


def test_pages_split_the_items():
    assert page(list(range(7)), 2, 5) == [5, 6]
