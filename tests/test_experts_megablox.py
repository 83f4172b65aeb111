"""The megablox expert backend (Pallas gmm/tgmm, interpret mode on CPU) against `dense`: forward
and gradients, experts that get no tokens, invalid ids, per-shard runs and inside `ep_a2a`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.close import assert_rel_close
from support.experts import expert_mesh, loss_and_grads

from gagar_jax.kernels.experts import ep as experts_ep
from gagar_jax.kernels.experts import registry as experts_registry

T, D, F, E, K = 32, 16, 8, 8, 2
LIVE = np.array([0, 2, 3, 5, 7])     # experts 1, 4 and 6 get no tokens


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
    g, u = (jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32) for _ in range(2))
    d = jnp.asarray(rng.normal(size=(E, F, D)) / np.sqrt(F), jnp.float32)
    idx = np.stack([rng.choice(LIVE, K, replace=False) for _ in range(T)]).astype(np.int32)
    idx[:12, 0] = 3          # a popular expert: its run spans several row tiles
    idx[3, 1] = -1           # "no expert" ids contribute 0
    idx[7, :] = E
    w = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
    return x, g, u, d, jnp.asarray(idx), w




@pytest.fixture(scope="module")
def reference(problem):
    return loss_and_grads("dense")(*problem)




def test_megablox_matches_dense_with_empty_experts(problem, reference):
    # Row tile 16 < T*K = 64 rows: groups straddle tiles; contraction/output tiles clamp to D, F.
    got = loss_and_grads("megablox", tiling=(16, 128, 128))(*problem)
    assert_rel_close(got, reference)
    (_, y), grads = got
    assert float(jnp.max(jnp.abs(y[7]))) == 0.0                   # every id invalid: zero row
    for gw in grads[1:4]:                                        # gate, up, down
        assert np.all(np.isfinite(gw))
        assert float(jnp.max(jnp.abs(gw[np.array([1, 4, 6])]))) == 0.0   # no tokens, no grad


def test_megablox_per_shard_under_a_mesh_matches_dense(problem, reference):
    # Tokens over data (4), F over tensor (2): shard_map per shard, tensor partial sums added.
    with jax.set_mesh(expert_mesh((4, 1, 1, 2))):
        got = loss_and_grads("megablox")(*problem)
    assert_rel_close(got, reference)


def test_ep_a2a_with_megablox_local_ffn_matches_dense(problem, reference):
    with jax.set_mesh(expert_mesh((4, 1, 2, 1))):
        got = loss_and_grads("ep_a2a", local="megablox",
                              exchange=experts_ep.emulated_ragged_all_to_all)(*problem)
    assert_rel_close(got, reference)
    with pytest.raises(ValueError, match="local="):
        with jax.set_mesh(expert_mesh((4, 1, 2, 1))):
            experts_registry.expert_ffn(*problem, backend="ep_a2a", local="nope")


def test_widths_the_tpu_kernels_cannot_tile_are_refused_clearly(problem):
    from gagar_jax.kernels.experts import megablox as experts_megablox
    assert experts_megablox.lowers_on_tpu(2048, 768) and experts_megablox.lowers_on_tpu(16, 16)
    assert not experts_megablox.lowers_on_tpu(16, 8)
    with pytest.raises(ValueError, match="multiples of 128"):
        experts_registry.expert_ffn(*problem, backend="megablox", interpret=False)
