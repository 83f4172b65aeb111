"""Compact arrays in feed records (`schema.PackedArray`) and their lazy decode.

`routed_experts` for a 200k-token trajectory of a 47-layer top-8 model is ~75M ids: as nested
JSON lists that is ~200 MB of text and seconds of parsing on every host. The compact form
carries the same values as little-endian bytes in base64, with the shape beside them
(docs/feed.md, "Compact arrays"):

    {"dtype": "uint8", "shape": [n, L, K], "b64": "..."}     # routed_experts: uint8 / uint16
    {"dtype": "int32", "shape": [n], "b64": "..."}           # tokens: int32 / uint32
    {"dtype": "float32", "shape": [n], "b64": "..."}         # logprobs

A routing value is an expert id, except the dtype's all-ones value (255 / 65535), which means
"no record" (-1 in the list form) whenever it is not a valid expert id (E <= 255 for uint8).

Decoding is split so that multi-host learners stay cheap and consistent:
- `array_error` / `header_error` (every host, every record): dtype, shape and the byte length
  implied by the base64 text's length, without decoding a byte (lengths are all the packing
  plan needs);
- `decode_array` / `decode_routed` (only the host that builds the row holding the trajectory,
  and only the part in its S range when hosts share rows): base64 -> numpy, values checked
  (vocabulary, finite, ids < E). Their failures are agreed between hosts by the batcher
  before a batch is handed out (`gagar_jax.feed.batcher`), so every host quarantines the same
  group.
"""
from __future__ import annotations

import binascii
import dataclasses
from typing import Optional

import numpy as np

from gagar_jax.feed import schema

# Little-endian on every host, whatever the machine's byte order.
DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2"), "int32": np.dtype("<i4"),
          "uint32": np.dtype("<u4"), "float32": np.dtype("<f4")}
# What each field may use (docs/feed.md, "Compact arrays").
ROUTED_DTYPES = schema.ROUTED_DTYPES
TOKEN_DTYPES = schema.TOKEN_DTYPES
LOGPROB_DTYPES = schema.LOGPROB_DTYPES


class PayloadError(ValueError):
    """A compact array that cannot be used; `reason` is a `validate.Reason` value."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# Reasons these checks report (validate.Reason holds them with the others).
ENCODING = "bad_encoding"               # a compact array that cannot be read
SHAPE = "routed_experts_shape"          # routing that does not match the model
VOCAB = "token_out_of_vocab"
NON_FINITE = "non_finite"


def _no_record(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


def pack(ids: np.ndarray, dtype: Optional[str] = None) -> schema.PackedArray:
    """Encodes an integer array (-1 = no record) as a `PackedArray`.

    Args:
      ids: expert ids >= -1, any shape (routed_experts: [n, L, K]).
      dtype: "uint8" or "uint16"; None picks the smallest that holds `ids`.
    Returns:
      The `PackedArray`; raises ValueError when `ids` do not fit `dtype`.
    """
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    low = int(ids.min()) if ids.size else 0
    top = int(ids.max()) if ids.size else 0
    if low < -1:
        raise ValueError(f"ids must be >= -1, got {low}")
    has_none = low == -1
    if dtype is None:
        dtype = next(name for name in ROUTED_DTYPES
                     if top < _no_record(DTYPES[name])
                     or (top == _no_record(DTYPES[name]) and not has_none) or name == "uint16")
    if dtype not in ROUTED_DTYPES:
        raise ValueError(f"dtype must be one of {ROUTED_DTYPES}, got {dtype!r}")
    dt = DTYPES[dtype]
    sentinel = _no_record(dt)
    if top > sentinel or (top == sentinel and has_none):
        raise ValueError(f"ids up to {top}{' with -1 entries' if has_none else ''} do not fit "
                         f"{dtype} (all-ones {sentinel} means no record)")
    raw = (np.where(ids < 0, sentinel, ids) if has_none else ids).astype(dt).tobytes()
    return schema.PackedArray(dtype=dtype, shape=[int(d) for d in ids.shape],
                              b64=binascii.b2a_base64(raw, newline=False).decode("ascii"))


def _b64_bytes(text: str) -> Optional[int]:
    """Bytes that padded base64 text of this length decodes to (None: not a valid length)."""
    n = len(text)
    if n % 4:
        return None
    pad = (n >= 1 and text[-1] == "=") + (n >= 2 and text[-2] == "=")
    return n // 4 * 3 - pad


def pack_array(values: np.ndarray, dtype: str) -> schema.PackedArray:
    """Encodes `tokens` ("int32" / "uint32") or `logprobs` ("float32") as a `PackedArray`."""
    if dtype not in TOKEN_DTYPES + LOGPROB_DTYPES:
        raise ValueError(f"dtype must be one of {TOKEN_DTYPES + LOGPROB_DTYPES}, got {dtype!r}")
    values = np.asarray(values)
    raw = values.astype(DTYPES[dtype]).tobytes()
    return schema.PackedArray(dtype=dtype, shape=[int(d) for d in values.shape],
                              b64=binascii.b2a_base64(raw, newline=False).decode("ascii"))


def array_error(packed: schema.PackedArray, field: str, dtypes: tuple,
                ndim: int) -> Optional[PayloadError]:
    """What is wrong with a compact array's dtype, rank or byte length (None: nothing),
    found without decoding it."""
    if packed.dtype not in dtypes:
        return PayloadError(ENCODING, f"{field}: dtype {packed.dtype!r}, expected one of {dtypes}")
    shape = tuple(packed.shape)
    if len(shape) != ndim or (shape and min(shape) < 0):
        return PayloadError(ENCODING, f"{field}: shape {list(shape)} is not {ndim}-d with "
                            "sizes >= 0")
    want = int(np.prod(shape)) * DTYPES[packed.dtype].itemsize
    got = _b64_bytes(packed.b64)
    if got != want:
        size = "not a padded base64 length" if got is None else f"{got} bytes"
        return PayloadError(
            ENCODING,
            f"{field}: b64 holds {size} ({len(packed.b64)} "
            f"characters), shape {list(shape)} of {packed.dtype} needs {want} bytes",
        )
    return None


def header_error(packed: schema.PackedArray, n_tokens: int, n_generated: int,
                 layers: int, top_k: int) -> Optional[PayloadError]:
    """What is wrong with a packed routed_experts, found without decoding it (None: nothing).

    Args:
      packed: the trajectory's `routed_experts`.
      n_tokens, n_generated: the trajectory's token count and generated-token count.
      layers, top_k: the model's L and K.
    """
    err = array_error(packed, "routed_experts", ROUTED_DTYPES, 3)
    if err is not None:
        return err
    shape = tuple(packed.shape)
    if shape[1:] != (layers, top_k) or shape[0] not in (n_tokens, n_generated):
        return PayloadError(
            SHAPE,
            f"routed_experts shape {list(shape)}, expected [n, {layers}, "
            f"{top_k}] with n = {n_generated} generated tokens or {n_tokens} tokens",
        )
    return None


def _raw(packed: schema.PackedArray, field: str, start: int = 0,
         stop: Optional[int] = None) -> np.ndarray:
    """The flat values of entries [start, stop) of the leading axis (default all).

    Only the base64 characters that hold those entries are decoded (4 characters carry 3
    bytes), so a host whose S range covers part of a long trajectory decodes that part; the
    byte length of the whole text was checked on arrival (`array_error`).
    """
    dt = DTYPES[packed.dtype]
    n = int(packed.shape[0]) if packed.shape else 1
    stop = n if stop is None else min(stop, n)
    start = min(start, stop)
    entry = int(np.prod(packed.shape[1:], dtype=np.int64)) * dt.itemsize   # bytes per entry
    b0, b1 = start * entry, stop * entry
    c0 = b0 // 3 * 4
    try:
        raw = binascii.a2b_base64(packed.b64[c0:-(-b1 // 3) * 4], strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise PayloadError(ENCODING, f"{field}: b64 is not valid base64: {e}") from None
    raw = raw[b0 - c0 // 4 * 3:][:b1 - b0]
    values = np.frombuffer(raw, dt)
    size = (b1 - b0) // dt.itemsize
    if values.size != size:
        raise PayloadError(ENCODING, f"{field}: b64 decodes to {values.size} {packed.dtype} "
                           f"values for entries [{start}, {stop}) of shape {list(packed.shape)}, "
                           f"which need {size}")
    return values


def decode_ints(packed: schema.PackedArray, field: str) -> np.ndarray:
    """All values of a 1-d integer compact array (e.g. `policy_versions`) as int64."""
    return _raw(packed, field).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class LazyArray:
    """A trajectory's compact `tokens` or `logprobs`, kept as text until its row is built.

    `length`: values kept (after any truncation); `vocab_size`: tokens are checked against it
    (None: logprobs, checked finite).
    """

    packed: schema.PackedArray
    field: str
    length: int
    vocab_size: Optional[int] = None


def decode_array(lazy: LazyArray, window: Optional[slice] = None) -> np.ndarray:
    """The first `length` values (or those of `window` within them): int32 token ids in
    [0, V), or finite float32 log-probs. Only the window's values are decoded and checked.

    Raises `PayloadError` (bad base64, a token id out of the vocabulary, a non-finite value).
    """
    lo, hi = (0, lazy.length) if window is None else (window.start, min(window.stop, lazy.length))
    values = _raw(lazy.packed, lazy.field, lo, hi)
    if lazy.vocab_size is None:
        if not np.isfinite(values).all():
            raise PayloadError(NON_FINITE, f"{lazy.field}: non-finite values")
        return values.astype(np.float32)
    if values.size and (int(values.min()) < 0 or int(values.max()) >= lazy.vocab_size):
        raise PayloadError(VOCAB, f"{lazy.field}: token ids must be in [0, {lazy.vocab_size}), "
                           f"got [{int(values.min())}, {int(values.max())}]")
    return values.astype(np.int32)


def _values(packed: schema.PackedArray, num_experts: Optional[int], start: int = 0,
            stop: Optional[int] = None) -> tuple:
    """(flat unsigned values of entries [start, stop), all-ones value, whether all-ones means
    no record), checked."""
    dt = DTYPES[packed.dtype]
    values = _raw(packed, "routed_experts", start, stop)
    sentinel = _no_record(dt)
    hi = num_experts if num_experts is not None else sentinel
    no_record = hi <= sentinel          # all-ones is not an expert id: it means no record
    if hi <= sentinel and values.size:  # else every value the dtype holds is an expert id
        bad = (values >= hi) & (values != sentinel)
        if bad.any():
            raise PayloadError(SHAPE, f"expert id {int(values[bad].max())} >= num_experts {hi}")
    return values, sentinel, no_record


def decode(packed: schema.PackedArray, num_experts: Optional[int]) -> np.ndarray:
    """The ids of a packed array as int32 (-1 = no record), checked against E.

    Assumes `header_error(packed, ...)` is None. Raises `PayloadError` for text that is not
    strict base64 or an id >= `num_experts`.
    """
    values, sentinel, no_record = _values(packed, num_experts)
    out = values.astype(np.int32).reshape(packed.shape)
    if no_record:
        out[out == sentinel] = -1
    return out


@dataclasses.dataclass(frozen=True)
class RoutedPayload:
    """A trajectory's packed routed_experts, kept as text until its row is built.

    `length` is the trajectory's token count after any truncation; `per_generated` says the
    entries are one per generated token (else one per token); `generated_after_cut` says the
    first token cut off by truncation was generated (its entry, whose input is the last kept
    token, stays).
    """

    packed: schema.PackedArray
    num_experts: Optional[int]
    length: int
    per_generated: bool
    generated_after_cut: bool = False


def decode_routed(payload: RoutedPayload, loss_mask: np.ndarray,
                  out: Optional[np.ndarray] = None, window: Optional[slice] = None) -> np.ndarray:
    """int32 [length, L, K] routed ids with token t as the input (-1 = no record).

    Args:
      payload: the lazy payload.
      loss_mask: the trajectory's (possibly truncated) 0/1 mask, [length].
      out: where to write (a slice of the batch, already -1); default: a new array. Writing
        in place spares a copy of the largest array the feed builds.
      window: tokens [start, stop) to write (out then has stop - start rows); default all.
    Returns:
      `out`. Raises `PayloadError` (bad base64, an id >= E).
    """
    lo, hi = (0, payload.length) if window is None else (window.start, window.stop)
    entry = tuple(payload.packed.shape[1:])
    if out is None:
        out = np.full((hi - lo,) + entry, -1, np.int32)
    # Only the window's entries are decoded (and checked against E).
    if payload.per_generated:
        # Entry j produced the j-th generated token at position t: its input was token t - 1.
        inputs = np.flatnonzero(loss_mask[:payload.length]) - 1
        if payload.generated_after_cut:
            inputs = np.append(inputs, payload.length - 1)
        # inputs increase with j: the window's entries are one contiguous run of them.
        j0, j1 = int(np.searchsorted(inputs, lo)), int(np.searchsorted(inputs, hi))
        values, sentinel, no_record = _values(payload.packed, payload.num_experts, j0, j1)
        out[inputs[j0:j1] - lo] = values.reshape((j1 - j0,) + entry)  # unsigned: cast once
    else:
        values, sentinel, no_record = _values(payload.packed, payload.num_experts, lo, hi)
        out[:] = values.reshape((hi - lo,) + entry)
    if no_record:
        out[out == sentinel] = -1
    return out
