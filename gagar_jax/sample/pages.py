"""The host side of the paged KV cache: page pools with reference counts, and live sequences.

A `Sequence` owns two page lists: `pages` (full-attention layers: position p in page p // T)
and `ring` (sliding-window layers: the last Wr positions, `kernels/attention/paged.py`). Pages
holding a prompt shared by N samples are shared by reference (a count per page); a page is
written only by a sequence that holds it alone (copy-on-write: `PagePool.private`). Plain
Python: the device arrays live in `cache.py`.
"""
from __future__ import annotations

import dataclasses


class PoolExhausted(RuntimeError):
    """Every page of a pool is held by live sequences."""


class PagePool:
    """Page ids 0..n-1 with reference counts.

    Args:
      n: pages in the pool.
      name: what the pool holds (for error messages).
    """

    def __init__(self, n: int, name: str):
        self.n, self.name = n, name
        self.refs = [0] * n
        self.free = list(range(n - 1, -1, -1))    # pop() hands out the lowest id first

    def alloc(self, k: int) -> list:
        """k fresh pages (reference count 1)."""
        if k > len(self.free):
            raise PoolExhausted(f"the {self.name} pool is exhausted: all {self.n} pages are held "
                                f"by live sequences (cancel finished sequences, or give the "
                                f"sampler more pages: SamplerConfig.num_pages)")
        out = [self.free.pop() for _ in range(k)]
        for p in out:
            self.refs[p] = 1
        return out

    def share(self, pages: list) -> list:
        """The same pages, one more holder each."""
        for p in pages:
            self.refs[p] += 1
        return list(pages)

    def release(self, pages: list) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)
            elif self.refs[p] < 0:
                raise RuntimeError(f"{self.name} page {p} released twice")

    def shared(self, page: int) -> bool:
        return self.refs[page] > 1

    @property
    def used(self) -> int:
        return self.n - len(self.free)


@dataclasses.dataclass
class Sequence:
    """A live sequence: every token of it, how many are in the cache, and its pages.

    Attributes:
      id: the engine's sequence id.
      tokens: the prompt, then every token generated or appended.
      fed: tokens whose keys and values are in the cache (tokens[:fed]); at rest it is
        len(tokens) - 1: the last token is fed by the next decode step.
      pages: full-layer page ids in position order.
      ring: window-ring page ids (empty for a model without sliding layers).
    """
    id: str
    tokens: list
    fed: int = 0
    pages: list = dataclasses.field(default_factory=list)
    ring: list = dataclasses.field(default_factory=list)


class Pages:
    """The full-layer pool and the ring pool of one sampler, and what they hand to sequences.

    Args:
      page: positions per page (T).
      num_pages: full-layer pages (0 when the model has no full layer).
      ring_pages: pages of one sequence's window ring (0 without sliding layers).
      num_ring_pages: ring pages in the pool.
    """

    def __init__(self, page: int, num_pages: int, ring_pages: int, num_ring_pages: int):
        self.page, self.ring_pages = page, ring_pages
        self.full = PagePool(num_pages, "full-attention KV page")
        self.rings = PagePool(num_ring_pages, "window-ring KV page")

    def new(self, seq_id: str, tokens: list) -> Sequence:
        """A sequence with its ring (its full pages come with `reserve`)."""
        return Sequence(seq_id, list(tokens), ring=self.rings.alloc(self.ring_pages))

    def reserve(self, seq: Sequence, positions: int) -> None:
        """Enough full pages for positions [0, positions)."""
        need = -(-positions // self.page) - len(seq.pages)
        if need > 0 and self.full.n:
            seq.pages += self.full.alloc(need)

    def private(self, seq: Sequence, first: int) -> list:
        """Copy-on-write before writing positions >= first: every page of `seq` from the one
        holding `first` on that another sequence also holds is swapped for a fresh one.
        Returns [(old page, new page)] (the caller copies their contents if it needs them)."""
        swaps = []
        for i in range(first // self.page, len(seq.pages)):
            if self.full.shared(seq.pages[i]):
                [new] = self.full.alloc(1)
                self.full.release([seq.pages[i]])
                swaps.append((seq.pages[i], new))
                seq.pages[i] = new
        return swaps

    def fork(self, seq: Sequence, seq_id: str) -> tuple:
        """A copy of `seq` sharing its full pages below `seq.fed` (whole pages only; a partial
        last page is copied) with fresh ring pages. Returns (the copy, [(src, dst)] full pages
        to copy, [(src, dst)] ring pages to copy)."""
        whole = seq.fed // self.page
        ring = self.rings.alloc(self.ring_pages)       # first: nothing to undo if it fails
        copies = []
        if seq.fed % self.page:
            try:
                [dst] = self.full.alloc(1)
            except PoolExhausted:
                self.rings.release(ring)
                raise
            copies.append((seq.pages[whole], dst))
        pages = self.full.share(seq.pages[:whole]) + [d for _, d in copies]
        new = Sequence(seq_id, list(seq.tokens), fed=seq.fed, pages=pages, ring=ring)
        return new, copies, list(zip(seq.ring, ring, strict=True))

    def drop(self, seq: Sequence) -> None:
        """Releases everything `seq` holds."""
        self.full.release(seq.pages)
        self.rings.release(seq.ring)
        seq.pages, seq.ring = [], []
