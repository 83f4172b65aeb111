"""An object store for tests: an fsspec in-memory file system behind `etils.epath`'s gs:// paths.

Like a real bucket it has neither append nor rename (both raise), so code that still relies on
them fails here. `use_memory_bucket(monkeypatch)` routes every `gs://...` path of
`etils.epath` to a fresh store and returns the file system (its `store` maps keys to files).
"""
from __future__ import annotations

import errno
import io

from etils.epath import backend as epath_backend
from fsspec.implementations.memory import MemoryFileSystem


class NoAppendNoRenameFS(MemoryFileSystem):
    """MemoryFileSystem without append or rename, keyed by "bucket/key" (no scheme)."""

    cachable = False
    protocol = ("gs",)

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.store, self.pseudo_dirs = {}, [""]      # a store of its own, not the class's

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path).removeprefix("gs://")
        return path.strip("/")

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode or "+" in mode:
            raise OSError(errno.EOPNOTSUPP, f"object store: no append ({mode!r})", path)
        key = self._strip_protocol(path)
        if "r" in mode and key in self.store:
            # A reader of its own: fsspec hands every reader one shared file object.
            return io.BytesIO(bytes(self.store[key].getvalue()))
        return super()._open(path, mode, **kwargs)

    def mv(self, *a, **k):
        raise OSError(errno.EOPNOTSUPP, "object store: no rename", str(a[:2]))

    rename = mv

    def objects(self) -> dict:
        """key -> bytes of every stored object."""
        return {k: bytes(f.getvalue()) for k, f in self.store.items()}


def use_memory_bucket(monkeypatch) -> NoAppendNoRenameFS:
    fs = NoAppendNoRenameFS()
    real = epath_backend._FileSystemSpecBackend.fs

    def route(self, path):
        return fs if str(path).startswith("gs://") else real(self, path)
    monkeypatch.setattr(epath_backend._FileSystemSpecBackend, "fs", route)
    return fs
