"""safetensors files on any `etils.epath` path (local, gs://, s3://): headers, byte-range reads of
sub-boxes, block-FP8 dequantization of a box, streaming writes.

A safetensors file is an 8-byte little-endian header length, a JSON header
(`name -> {dtype, shape, data_offsets}`) and the raw C-order little-endian bytes of each tensor.
`Checkpoint.read_box(name, box)` reads only the bytes of the box `[start, stop)` per dimension.
On object stores (and any non-local epath) the box is cut into contiguous runs (the trailing
dimensions it spans whole, plus its extent in the first dimension it cuts) and each run is one
ranged `seek` + `read`, adjacent runs merged: nothing outside the box is requested. Local files
are memory-mapped for the call and only the box is copied out (in C); the kernel pages in what
the box touches (whole 4 KiB pages), and the mapping is dropped before returning. The mapping is
advised `MADV_RANDOM` (no read-ahead: with the default the kernel reads up to `read_ahead_kb`,
often 8 MiB, past every fault, so a process needing half a file read nearly all of it), then the
pages the box touches are prefetched with `MADV_WILLNEED` (adjacent pages merged into one range:
large requests, not one synchronous 4 KiB read per fault). Nothing outside those pages is read;
a box whose runs are shorter than a page still reads whole pages (a (D, D) float32 weight cut
along its last axis reads every page when D <= 1024). scripts/bench_weights_io.py --cold
measures the bytes read per process.

A file shorter than its header says (a truncated download or copy) is an error naming the file,
the tensor and the byte range it needs against the file's size.

The installed numpy reader cannot read F8_E4M3 or BF16, which ml_dtypes provides.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import ml_dtypes
import numpy as np
from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.publish_format import INDEX_FILE, SINGLE_FILE

ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32,
             "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_PAGE = mmap.PAGESIZE
WILLNEED_CHUNK = 128 << 10   # bytes per MADV_WILLNEED call (see `advise`)


def read_header(fname: epath.PathLike) -> tuple:
    """(header dict without __metadata__, byte offset of the data section) of a safetensors file."""
    with epath.Path(fname).open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{fname}: not a safetensors file: {len(head)} bytes, shorter than "
                             "the 8-byte header length (truncated?)")
        (n,) = struct.unpack("<Q", head)
        blob = f.read(n)
    if len(blob) < n:
        raise ValueError(f"{fname}: truncated safetensors header: needs bytes [8, {8 + n}), the "
                         f"file has {8 + len(blob)}")
    try:
        header = json.loads(blob)
    except ValueError as e:
        raise ValueError(f"{fname}: unreadable safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def _truncated(fname: epath.PathLike, name: str, lo: int, hi: int, size: int) -> ValueError:
    return ValueError(f"{fname} is truncated: tensor {name} needs bytes [{lo}, {hi}) of the file, "
                      f"which has {size} bytes")


def _runs(shape: Sequence[int], box: Sequence[tuple], itemsize: int) -> tuple:
    """(byte offsets, run length) of the contiguous runs covering `box` in a C-order array."""
    shape = list(shape)
    k = len(shape)          # dims k.. are spanned whole by the box
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        return np.zeros(1, np.int64), int(np.prod(shape, dtype=np.int64)) * itemsize
    inner = int(np.prod(shape[k:], dtype=np.int64)) * itemsize   # bytes of one step in dim k-1
    run = (box[k - 1][1] - box[k - 1][0]) * inner
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) * itemsize for d in range(k - 1)]
    offsets = np.full(1, box[k - 1][0] * inner, np.int64)
    for d in range(k - 1):  # outer product of the leading dims' indices
        idx = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
        offsets = (idx[:, None] + offsets[None, :]).reshape(-1)
    return offsets, run


class Checkpoint:
    """The safetensors files of one checkpoint directory (single file or sharded with an index)."""

    def __init__(self, path: epath.PathLike):
        self.path = epath.Path(path)
        index = self.path / INDEX_FILE
        self._headers: dict = {}
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = self.path / SINGLE_FILE
            if not single.exists():
                raise FileNotFoundError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
            self._headers[single] = read_header(single)
            self.weight_map = {k: SINGLE_FILE for k in self._headers[single][0]}
        self._lock = threading.Lock()

    @property
    def names(self) -> set:
        return set(self.weight_map)

    def entry(self, name: str) -> tuple:
        """(header entry {dtype, shape, data_offsets}, data start, file path) of tensor `name`."""
        if name not in self.weight_map:
            raise KeyError(f"checkpoint {self.path} has no tensor {name!r}")
        fname = self.path / self.weight_map[name]
        with self._lock:
            if fname not in self._headers:
                self._headers[fname] = read_header(fname)
        header, start = self._headers[fname]
        e = header[name]
        if e["dtype"] not in ST_DTYPES:
            raise ValueError(f"{fname}: tensor {name}: unsupported safetensors dtype {e['dtype']}")
        return e, start, fname

    def shape(self, name: str) -> tuple:
        return tuple(self.entry(name)[0]["shape"])

    def read_box(self, name: str, box: Sequence[tuple] | None = None) -> np.ndarray:
        """The sub-array `[b0:e0, b1:e1, ...]` of tensor `name`, reading only its bytes.

        Args:
          name: tensor name.
          box: (start, stop) per dimension; None = the whole tensor.
        Returns:
          A numpy array of the tensor's stored dtype (ml_dtypes for BF16 / F8_E4M3).
        """
        e, start, fname = self.entry(name)
        shape = tuple(e["shape"])
        box = [(0, n) for n in shape] if box is None else [(int(a), int(b)) for a, b in box]
        if len(box) != len(shape) or any(
            not 0 <= a <= b <= n for (a, b), n in zip(box, shape, strict=False)
        ):
            raise ValueError(f"{name}: box {box} does not fit shape {shape}")
        dt = np.dtype(ST_DTYPES[e["dtype"]]).newbyteorder("<")
        out_shape = tuple(b - a for a, b in box)
        out = np.empty(out_shape, dt)
        if out.size == 0:
            return out
        base = start + e["data_offsets"][0]
        nbytes = e["data_offsets"][1] - e["data_offsets"][0]
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"{fname}: tensor {name}: data_offsets {e['data_offsets']} hold "
                             f"{nbytes} bytes, its {e['dtype']} shape {list(shape)} needs "
                             f"{int(np.prod(shape, dtype=np.int64)) * dt.itemsize}")
        offsets, run = _runs(shape, box, dt.itemsize)
        if not is_remote(fname):   # local file: map it, copy only the box (in C)
            _read_local(os.fspath(fname), name, base, nbytes, shape, box, dt, out, offsets, run)
            return out
        flat = out.reshape(-1).view(np.uint8)
        with fname.open("rb") as f:
            for pos, off, length in _merged(offsets, run):
                f.seek(base + off)
                if _read_into(f, memoryview(flat[pos:pos + length])) < length:
                    raise _truncated(fname, name, base, base + nbytes, f.seek(0, os.SEEK_END))
        return out


def _merged(offsets: np.ndarray, run: int) -> Iterator[tuple]:
    """(position in the box, offset in the tensor, length) of each maximal run of adjacent runs."""
    pos, i, n = 0, 0, len(offsets)
    while i < n:
        j = i + 1
        while j < n and offsets[j] == offsets[j - 1] + run:
            j += 1
        yield pos, int(offsets[i]), run * (j - i)
        pos, i = pos + run * (j - i), j


def page_ranges(base: int, offsets: np.ndarray, run: int) -> tuple:
    """(first byte, length) arrays of the page-aligned ranges the runs touch, adjacent ones merged:
    exactly the pages a box needs, nothing between them."""
    lo = (base + offsets) // _PAGE
    hi = (base + offsets + run - 1) // _PAGE + 1
    new = np.concatenate([[True], lo[1:] > hi[:-1]])   # runs are in ascending order
    starts, ends = lo[new], np.concatenate([hi[:-1][new[1:]], hi[-1:]])
    return starts * _PAGE, (ends - starts) * _PAGE


def advise(mm: mmap.mmap, base: int, offsets: np.ndarray, run: int) -> None:
    """Random access on the whole mapping (no read-ahead past a fault), then a prefetch of exactly
    the pages the box touches (`MADV_WILLNEED`: large requests instead of a fault per page)."""
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    if hasattr(mmap, "MADV_WILLNEED"):
        for start, length in zip(*page_ranges(base, offsets, run), strict=True):
            end = min(int(start + length), len(mm))
            # Linux honours one WILLNEED only up to max(read_ahead_kb, max_sectors_kb) and drops
            # the rest, so ask in pieces no device setting cuts short.
            for lo in range(int(start), end, WILLNEED_CHUNK):
                mm.madvise(mmap.MADV_WILLNEED, lo, min(WILLNEED_CHUNK, end - lo))


def _read_local(path: str, name: str, base: int, nbytes: int, shape: tuple, box: list,
                dt: np.dtype, out: np.ndarray, offsets: np.ndarray, run: int) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if base + nbytes > size:
            raise _truncated(path, name, base, base + nbytes, size)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        advise(mm, base, offsets, run)
        whole = np.frombuffer(mm, np.uint8, count=nbytes, offset=base)
        out[...] = whole.view(dt).reshape(shape)[tuple(slice(a, b) for a, b in box)]
    finally:
        whole = None  # the buffer must be released before the mapping closes
        mm.close()     # unmapped: the pages leave this process's RSS


def _read_into(f: BinaryIO, view: memoryview) -> int:
    """Reads into `view` until full or end of file; the bytes read."""
    got = 0
    while got < len(view):   # straight into the output: no second copy of the bytes
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def dequantize_block_fp8(q: np.ndarray, scale_inv: np.ndarray, block: tuple = (128, 128),
                         origin: tuple = (0, 0)) -> np.ndarray:
    """W[i, j] = q[i, j] * scale_inv[i // bi, j // bj] in float32 (partial edge blocks included).

    `q` may be a box of the weight starting at `origin` = (row, col); `scale_inv` then holds the
    scale rows/columns from block `origin // block` on (as `Checkpoint.read_box` returns them).
    """
    bi, bj = block
    rows, cols = q.shape
    r0, c0 = origin
    want = (-(-(r0 + rows) // bi) - r0 // bi, -(-(c0 + cols) // bj) - c0 // bj)
    if scale_inv.shape != want:
        raise ValueError(f"weight_scale_inv shape {scale_inv.shape} != {want} for a {q.shape} "
                         f"weight in {bi}x{bj} blocks")
    ri = (np.arange(r0, r0 + rows) // bi) - r0 // bi
    ci = (np.arange(c0, c0 + cols) // bj) - c0 // bj
    return q.astype(np.float32) * scale_inv.astype(np.float32)[ri[:, None], ci[None, :]]


def write_safetensors(fname: epath.PathLike, tensors: dict, metadata: dict | None = None,
                      digests: dict | None = None) -> int:
    """Writes numpy arrays as one safetensors file (streamed, one tensor at a time); \
returns bytes. `digests`, if given, gets {file name: sha256 hex of the bytes written}."""
    names = {np.dtype(v): k for k, v in ST_DTYPES.items()}
    header, offset = {}, 0
    for name in sorted(tensors):
        a = tensors[name]
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    digest = hashlib.sha256() if digests is not None else None
    with epath.Path(fname).open("wb") as f:
        for piece in itertools.chain(
                (struct.pack("<Q", len(blob)), blob),
                (memoryview(np.ascontiguousarray(tensors[n]).reshape(-1).view(np.uint8))
                 for n in sorted(tensors))):
            f.write(piece)
            if digest is not None:     # what this process wrote, hashed as it is written
                digest.update(piece)
    if digest is not None:
        digests[epath.Path(fname).name] = digest.hexdigest()
    return 8 + len(blob) + offset
