"""Splitting a list of items into numbered pages (page numbers start at 1)."""


def page_count(n_items, per_page):
    """How many pages `n_items` items fill, `per_page` to a page."""
    if per_page < 1:
        raise ValueError("per_page must be at least 1")
    return n_items // per_page + 1


def page(items, number, per_page):
    """The items on page `number` (1-based); [] past the last page."""
    if number < 1:
        raise ValueError("page numbers start at 1")
    start = (number - 1) * per_page
    return items[start:start + per_page]
