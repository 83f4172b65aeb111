"""Object-store stand-ins for `etils.epath` (registered with fsspec as the gs:// protocol) that
count the bytes read and written through their files: the storage layer, not the loader's own
arithmetic. Neither supports rename or append, like an object store.

- `MemoryStore`: fsspec's in-memory filesystem (one process).
- `LocalStore`: gs://bucket/x lives at $GAGAR_TEST_STORE_ROOT/bucket/x (shared by processes).
"""
import collections
import io
import os

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

COUNTS = collections.Counter()   # "read" / "write" bytes through binary files


class _Counted:
    def __init__(self, f):
        self.f = f

    def read(self, n=-1):
        b = self.f.read(n)
        COUNTS["read"] += len(b)
        return b

    def readinto(self, buf):
        n = self.f.readinto(buf)
        COUNTS["read"] += n or 0
        return n

    def write(self, b):
        n = memoryview(b).nbytes
        COUNTS["write"] += n
        self.f.write(b)
        return n

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


class _ObjectStoreRules:
    def _open(self, path, mode="rb", **kw):
        if "a" in mode:
            raise OSError(f"object store: no append ({path})")
        f = super()._open(path, mode=mode, **kw)
        return _Counted(f) if "b" in mode else f

    def mv(self, *a, **kw):
        raise OSError("object store: no rename")

    rename = move = mv


class MemoryStore(_ObjectStoreRules, MemoryFileSystem):
    protocol = ("gs", "gcs")
    cachable = False

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode=mode, **kw)
        if mode == "rb":   # fsspec hands every reader the same file object: give each its own
            return _Counted(io.BytesIO(f.f.getvalue()))
        return f

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(str(path).replace("gs://", "memory://", 1))


class LocalStore(_ObjectStoreRules, LocalFileSystem):
    protocol = ("gs", "gcs")

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("gs://"):
            path = os.path.join(os.environ["GAGAR_TEST_STORE_ROOT"], path[len("gs://"):])
        return LocalFileSystem._strip_protocol(path)


def register(cls) -> None:
    """Makes gs:// paths of `etils.epath` use `cls` (also when epath already cached a gcs fs)."""
    from etils.epath import backend
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, cls, clobber=True)
    backend.fsspec_backend._get_filesystem.cache_clear()
