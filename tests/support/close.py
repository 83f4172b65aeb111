"""Comparing two different XLA programs: a norm-relative tolerance that float reassociation
on any CPU cannot break, where an element-wise `atol` can (one element of a gradient summed in
another order). Identical programs are compared exactly instead."""
import jax
import numpy as np

# fp32: ~1e-7 per rounding, grown by the length of the reductions these tiny tests run (< 10^3),
# with a margin; a wrong implementation is off by 1e-2 or more.
FP32_RTOL = 1e-5


def rel_err(actual, expected) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a = np.asarray(actual, np.float64)
    b = np.asarray(expected, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den > 0 else float(num)


def assert_rel_close(actual, expected, rtol: float = FP32_RTOL, name: str = "") -> None:
    """||a - b|| / ||b|| <= rtol for every array of two pytrees of the same structure."""
    pa = jax.tree_util.tree_flatten_with_path(actual)[0]
    pb = jax.tree_util.tree_leaves(expected)
    assert len(pa) == len(pb), (len(pa), len(pb))
    for (path, a), b in zip(pa, pb, strict=False):
        err = rel_err(a, b)
        assert err <= rtol, (
            f"{name}{jax.tree_util.keystr(path)}: relative error {err:.3g} > {rtol:g}"
        )
