"""Round three, Design A (`sim/tabular.py`): the grader table in jnp against the NumPy one, the
control's advantages against their definition, the zero-gradient argument on the library loss
against a NumPy formula, and the `--quick` run (resumable, reported).
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import miniature_tabular  # scripts/miniature_tabular.py (pytest puts scripts/ on the path)
import numpy as np
import pytest

from gagar_jax import grading
from gagar_jax.sim import tabular, tabular_report


def _batch(rng, G=6, n=8):
    ans = rng.integers(0, tabular.NUM_PASS + 2, size=G * n)
    passed = ans < tabular.NUM_PASS
    tier = tabular.ANSWER_TIERS[np.minimum(ans, tabular.NUM_PASS - 1)]
    rank = tabular.ANSWER_RANKS[np.minimum(ans, tabular.NUM_PASS - 1)]
    return ans, passed, tier, rank, np.arange(G * n) // n


def test_table_factors_match_the_grading_module():
    rng = np.random.default_rng(0)
    for _ in range(5):
        _, passed, tier, rank, gid = _batch(rng)
        got = np.asarray(tabular.table_factors(jnp.asarray(tier), jnp.asarray(rank),
                                               jnp.asarray(passed), jnp.asarray(gid), 6))
        want = grading.quality_factors(np.where(passed, tier, -9), rank, gid, num_groups=6)
        np.testing.assert_allclose(got, np.where(passed, want, 1.0), rtol=1e-6)


def test_arm_advantages_binary_downweight_and_control_by_definition():
    rng = np.random.default_rng(1)
    _, passed, tier, rank, gid = _batch(rng)
    r = passed.astype(np.float32)
    f = np.asarray(tabular.table_factors(jnp.asarray(tier), jnp.asarray(rank),
                                         jnp.asarray(passed), jnp.asarray(gid), 6))
    advs, _, caps = tabular.arm_advantages(jnp.asarray(r), jnp.asarray(f), jnp.asarray(gid), 6)
    advs = np.asarray(advs)
    want = {a: np.zeros(r.size) for a in ("binary", "downweight_only", "control")}
    for g in range(6):
        m = gid == g
        k, n = r[m].sum(), m.sum()
        if not 0 < k < n:
            continue
        A = r[m] - k / n
        want["binary"][m] = A
        want["downweight_only"][m] = np.where(r[m] > 0, f[m] * A, A)
        want["control"][m] = A - np.sum((1 - f[m]) * A * r[m]) / n      # sim/arms.py's control
    for name, w in want.items():
        np.testing.assert_allclose(advs[tabular.ARM_NAMES.index(name)], w, atol=1e-6)
    # Both sum-preserving arms are zero-sum per group; the cap fires only in the capped arm.
    for name in ("sum_preserving", "sum_preserving_cap"):
        sums = np.bincount(gid, advs[tabular.ARM_NAMES.index(name)], minlength=6)
        np.testing.assert_allclose(sums, 0.0, atol=1e-5)
    assert not np.asarray(caps)[tabular.ARM_NAMES.index("sum_preserving")].any()


def test_library_loss_gradient_is_zero_on_unsampled_tokens_iff_the_credit_sums_to_zero():
    # grad[l, k] = -(1 / (N L)) sum_i A_i (1[y_il = k] - pi_lk) for the PPO objective at ratio 1.
    rng = np.random.default_rng(2)
    L, V, N = 3, 50, 8
    logits = rng.normal(size=(L, V)).astype(np.float32)
    tokens = rng.integers(0, 5, size=(N, L)).astype(np.int32)       # tokens >= 5 never sampled
    pi = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    for adv in (np.array([0.5, -0.5, 0.25, -0.25, 0.0, 0.1, -0.1, 0.0]),       # zero-sum
                np.array([0.3, -0.5, 0.25, -0.25, 0.0, 0.1, -0.1, 0.0])):      # net -0.2
        g = jax.grad(lambda lg, a=adv: tabular.loss_fn(lg, jnp.asarray(tokens),
                                                       jnp.asarray(a, jnp.float32))[0])(
            jnp.asarray(logits))
        onehot = np.zeros((N, L, V))
        onehot[np.arange(N)[:, None], np.arange(L)[None, :], tokens] = 1
        want = -np.einsum("i,ilk->lk", adv, onehot - pi[None]) / (N * L)
        np.testing.assert_allclose(np.asarray(g), want, atol=1e-7)
        unsampled = np.asarray(g)[:, 5:]
        if abs(adv.sum()) < 1e-9:
            np.testing.assert_allclose(unsampled, 0.0, atol=1e-9)
        else:       # net-negative credit: every never-sampled token is pushed up (grad < 0)
            assert (unsampled < 0).all()


def test_initial_policy_matches_the_design():
    cfg = tabular.TabularConfig()
    rep = tabular.step0_report(cfg)
    assert abs(rep["entropy_filler"] - 0.4) < 1e-3 and abs(rep["top_filler"] - 0.95) < 1e-4
    assert abs(rep["pass_prob_exact"] - 0.5) < 1e-4 and rep["nucleus_filler"] == 1
    u = jnp.asarray(np.random.default_rng(0).uniform(size=(20000, 1)), jnp.float32)
    p = jnp.asarray([[0.1, 0.6, 0.3]])
    counts = np.bincount(np.asarray(tabular.sample(p, u))[:, 0], minlength=3) / 20000
    np.testing.assert_allclose(counts, [0.1, 0.6, 0.3], atol=0.01)
    keep = np.asarray(tabular.nucleus(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]), 0.9))
    assert keep.tolist() == [[True, True, True, False]]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tabA") / "out")
    assert miniature_tabular.main(["--quick", "--out", out]) == 0
    return out


def test_quick_writes_every_run_the_report_and_the_plots(quick):
    cfg = tabular.TabularConfig.quick()
    table = tabular_report.load_steps(os.path.join(quick, "steps.csv.gz"))
    assert len(table) == 2 * 2 * len(tabular.ARM_NAMES)
    for (_, smp, arm), seeds in table.items():
        assert sorted(seeds) == list(range(cfg.seeds))
        for row in seeds.values():
            assert row["entropy_filler"].size == cfg.steps
            net = row["net_credit_per_seq"]
            if arm in ("binary", "sum_preserving", "sum_preserving_cap"):
                assert np.abs(net).max() < 1e-5
            else:
                assert net.mean() < 0
            if smp == "top_p" and arm in ("binary", "sum_preserving"):
                # One-token nucleus on the filler rows, zero-sum credit: no gradient there.
                assert np.abs(row["entropy_filler"] - row["entropy_filler"][0]).max() < 1e-4
    # Common random numbers: at step 0 every arm of a (optimizer, sampler, seed) saw one batch.
    for opt in ("adam", "sgd"):
        for smp in tabular.SAMPLERS:
            rates = {table[(opt, smp, a)][0]["pass_rate"][0] for a in tabular.ARM_NAMES}
            assert len(rates) == 1
    for name in ("table.md", "criteria.md", "entropy.png", "net_credit.png", "is_weights.png"):
        assert os.path.exists(os.path.join(quick, name)), name
    with open(os.path.join(quick, "meta.json")) as f:
        assert json.load(f)["config"]["vocab"] == cfg.vocab
    # --report rebuilds the same tables from the CSV alone (the plots above are the same code).
    before = open(os.path.join(quick, "criteria.md")).read()
    os.remove(os.path.join(quick, "criteria.md"))
    assert miniature_tabular.main(["--report", "--no-plots", "--out", quick]) == 0
    assert open(os.path.join(quick, "criteria.md")).read() == before


def test_a_run_resumes_from_its_last_chunk_exactly(tmp_path):
    cfg = tabular.TabularConfig.quick()      # the quick run's shapes: its compile is reused
    straight = tabular.run(cfg, "adam", None, log=lambda s: None)
    half = dataclasses.replace(cfg, steps=cfg.chunk)
    tabular.run(half, "adam", str(tmp_path), log=lambda s: None)
    resumed = tabular.run(cfg, "adam", str(tmp_path), log=lambda s: None)
    for k, v in straight["metrics"].items():
        np.testing.assert_array_equal(resumed["metrics"][k], v, err_msg=k)
    np.testing.assert_array_equal(resumed["final_entropy_filler"], straight["final_entropy_filler"])


def test_unknown_optimizer_is_one_clear_error(capsys):
    assert miniature_tabular.main(["--quick", "--optimizers", "rmsprop"]) == 2
    assert "--optimizers" in capsys.readouterr().err
