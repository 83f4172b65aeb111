"""Parameter fingerprints without gathers: SHA-256 and L2 norm per canonical unit.

Definition (docs/checkpoints.md, "Parameter fingerprints"). Leaves are visited in sorted order of
their key paths (`jax.tree_util.keystr`). Each leaf is cut into units along its leading axes:
for a model parameter the units of `param_units` (one per layer, or per (layer, expert) of a
stacked expert leaf, the whole leaf at the top level); for any other array one unit per index of
its first axis (0-d arrays: one unit). Then

    unit digest  d(leaf, u) = SHA-256(little-endian C-order bytes of unit u)
    params_sha256 = SHA-256( for each leaf, for each unit u in C order:
                             len(h) as 8 bytes little-endian, h, d(leaf, u) )
                    with h = JSON [key path, dtype name, leaf shape, u]
    params_l2     = sqrt( sum over leaves and units, in that order, of the float64 sum of
                          squares of the unit's values (C order cut into rows of 1024, the
                          rows added element-wise one after another, the 1024 sums added
                          exactly) )

Units never span processes (they are resharded on device with `units.to_owners`), each
process hashes its own, and only the 32-byte digests and float64 sums cross processes. So both
values are identical on 1 and N processes and any mesh, and no process gathers a leaf.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from gagar_jax import sharding
from gagar_jax.hf import units as param_units


def _lead(kp: tuple, x: jax.Array | np.ndarray) -> int:
    try:
        return param_units.unit_lead(sharding.leaf_path(kp), x.ndim)
    except (KeyError, ValueError):   # not a model parameter: rows of the first axis
        return min(x.ndim, 1)


def _sum_squares(a: np.ndarray) -> float:
    """float64 sum of squares in a fixed order: 1024 column sums, row after row (an element-wise
    add, unlike np.sum's pairwise SIMD reduction whose rounding follows memory alignment), then an
    exact sum of the 1024."""
    v = np.square(a.astype(np.float64).reshape(-1))
    v = np.concatenate([v, np.zeros(-v.size % 1024)]).reshape(-1, 1024)
    return math.fsum(v.sum(axis=0))


def _unit_stats(units: dict, n: int) -> tuple:
    """(digests [n, 32] uint8, float64 sums of squares [n]) of {u: numpy unit}; rows of units
    not given stay 0."""
    dig, sq = np.zeros((n, 32), np.uint8), np.zeros(n, np.float64)
    for u, a in units.items():
        a = np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"), copy=False))
        dig[u] = np.frombuffer(hashlib.sha256(a.reshape(-1).view(np.uint8)).digest(), np.uint8)
        if a.dtype.kind in "fiub" or a.dtype.name in ("bfloat16", "float8_e4m3fn"):
            sq[u] = _sum_squares(a)
    return dig, sq


def _leaf_stats(kp: tuple, x: jax.Array | np.ndarray) -> tuple:
    """(name, dtype name, shape, digests [U, 32], sums [U]) of one leaf; every process calls it."""
    name = jax.tree_util.keystr(kp)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        x = jax.random.key_data(x)
    lead = _lead(kp, x)
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        a = np.asarray(jax.device_get(x))
        units = a.reshape((-1,) + a.shape[lead:]) if a.ndim else a.reshape(1)
        dig, sq = _unit_stats(dict(enumerate(units)), len(units))
        return name, a.dtype.name, a.shape, dig, sq
    # Spans processes: each process hashes the units it owns after an on-device reshard.
    lu = param_units.LeafUnits(name, tuple(x.shape), lead, x.dtype.name, jax.process_count())
    mine = param_units.host_units(param_units.to_owners(x, lu, param_units.process_mesh()), lu)
    dig, sq = _unit_stats(mine, lu.units)
    all_d = np.asarray(multihost_utils.process_allgather(dig))   # [P, U, 32]
    # float64 travels as bytes: jax (without x64) would round it to float32 on the way.
    all_s = np.asarray(multihost_utils.process_allgather(sq.view(np.uint8))).view(np.float64)
    owners = np.array([lu.owner(u) for u in range(lu.units)])
    rows = np.arange(lu.units)
    return name, x.dtype.name, tuple(x.shape), all_d[owners, rows], all_s[owners, rows]


def params_fingerprint(params: Any) -> tuple:
    """(params_sha256 hex digest, params_l2) of a pytree of arrays; see the module docstring.

    Call on every process when arrays span processes (it runs small collectives).
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    digest, total = hashlib.sha256(), 0.0
    for kp, x in sorted(flat, key=lambda kx: jax.tree_util.keystr(kx[0])):
        name, dtype, shape, dig, sq = _leaf_stats(kp, x)
        for u in range(len(dig)):
            h = json.dumps([name, dtype, list(shape), u]).encode()
            digest.update(len(h).to_bytes(8, "little") + h + dig[u].tobytes())
        for s in sq:
            total += float(s)
    return digest.hexdigest(), float(np.sqrt(total))


def params_sha256(params: Any) -> str:
    """SHA-256 of all parameters per canonical unit (module docstring), independent of sharding
    and process count; no leaf is gathered."""
    return params_fingerprint(params)[0]


def params_l2(params: Any) -> float:
    """Global L2 norm of all parameters: float64 sums of squares per canonical unit, added in
    canonical order (the same value on any mesh and process count)."""
    return params_fingerprint(params)[1]
