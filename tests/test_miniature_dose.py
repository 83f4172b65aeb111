"""Round four's tabular dose-response (`gagar_jax/sim/dose.py`): the shift arm by hand, the
factorised policy's initial state, and a tiny run whose first-order behaviour is known."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from gagar_jax.sim import dose
from gagar_jax.sim import tabular as T


def test_shift_advantages_by_hand():
    # group 0 mixed (2 of 4 pass), group 1 all pass, group 2 all fail
    r = jnp.array([1, 0, 0, 1, 1, 1, 0, 0], jnp.float32)
    gid = jnp.array([0, 0, 0, 0, 1, 1, 2, 2], jnp.int32)
    c = -0.1
    got = np.asarray(dose.shift_advantages(r, gid, 3, jnp.float32(c)))
    want = np.array([0.5 + c, -0.5 + c, -0.5 + c, 0.5 + c, 0, 0, 0, 0], np.float32)
    np.testing.assert_allclose(got, want, atol=1e-7)
    # c = 0 is binary: zero-sum per group
    got0 = np.asarray(dose.shift_advantages(r, gid, 3, jnp.float32(0.0)))
    np.testing.assert_allclose(got0[:4].sum(), 0.0, atol=1e-7)


def test_factorised_policy_starts_at_the_table():
    cfg = dose.DoseConfig.quick()
    table = dose.logits_of(cfg, dose.init_params(cfg, "table"))
    factor_params = dose.init_params(cfg, "factor")
    np.testing.assert_array_equal(np.asarray(dose.logits_of(cfg, factor_params)),
                                  np.asarray(table))
    assert factor_params["h"].shape == (cfg.tab.length, cfg.dim)
    np.testing.assert_allclose(np.linalg.norm(np.asarray(factor_params["h"]), axis=1), 1.0,
                               rtol=1e-6)
    with pytest.raises(ValueError, match="param must be one of"):
        dose.init_params(cfg, "lowrank")


@pytest.fixture(scope="module")
def tiny_sgd():
    tab = dataclasses.replace(T.TabularConfig.quick(), vocab=64, length=4, groups=4, steps=10,
                              seeds=2)
    cfg = dose.DoseConfig(tab=tab, dim=4)
    return cfg, dose.run(cfg, "sgd", "table", log=lambda s: None)


def test_tiny_sgd_table_effect_is_linear_in_the_shift_under_top_p(tiny_sgd):
    cfg, res = tiny_sgd
    eff = dose.window_effects(cfg, res, width=5)
    # Under top-p the filler nucleus is the top token alone: its gradient is -(c / L)(e_top -
    # pi), the same in every seed, so SGD's effect is linear in c to first order (ratio 8).
    top = [float(np.mean(eff[("top_p", c)])) for c in cfg.shifts]
    assert all(x > 0 for x in top)
    assert 6 <= top[-1] / top[0] <= 10
    # Without truncation the push cancels in expectation: far smaller than under top-p.
    exact = [float(np.mean(eff[("exact", c)])) for c in cfg.shifts]
    assert max(abs(x) for x in exact) < 0.25 * top[-1]
    # The net credit per trajectory is c on mixed groups, 0 for binary.
    idx, net = res["index"], res["metrics"]["net_credit_per_seq"]
    assert np.all(np.abs(net[idx["arm"] == 0]) < 1e-6)
    assert np.all(net[idx["arm"] == 4] <= 0) and np.all(net[idx["arm"] == 4] >= -0.2 - 1e-6)
