"""Gagar advantages: outcome advantages, quality redistribution, the lambda cap, equivalent rewards.

Everything is element-wise over trajectories [T] plus segment reductions over groups [G]; there
is no Python loop over groups or trajectories, so one compiled function serves every batch of
the same padded shape. The rules and the identities INV-1..INV-9 (and the length-aware mode's
INV-1W..INV-5W) are explained in docs/advantage.md; `advantage_checks.check_invariants` asserts
them inside jit.
"""
from __future__ import annotations

import numbers
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp

MODES = ("sum_preserving", "downweight_only", "binary", "length_aware")
WEIGHTED_MODES = ("length_aware",)   # modes that need per-trajectory weights
STD_EPS = 1e-6     # verl's epsilon of norm_adv_by_std_in_grpo


@flax.struct.dataclass
class GroupOutcomes:
    """What the feed says about one batch's trajectories and groups: the advantage's inputs."""
    rewards_T: jax.Array                 # f32 binary outcome 0/1
    group_ids_T: jax.Array               # int group index in [0, G) (ignored for invalid ones)
    factors_T: jax.Array                 # f32 quality factor in (0, 1]; read for passes only
    valid_T: jax.Array                   # bool: false for infra failures and padding
    hacked_T: jax.Array                  # bool: grader-confirmed reliance on a leaked answer
    grading_ok_G: jax.Array              # bool: false = grading failed (outcome advantages kept)
    adjustments_T: Optional[jax.Array] = None   # f32 additive reward adjustments (rule 9)

    @property
    def num_groups(self) -> int:
        return self.grading_ok_G.shape[0]

    @classmethod
    def of_batch(cls, batch: Any) -> GroupOutcomes:
        """The outcome fields of a packed `Batch`."""
        return cls(rewards_T=batch.rewards_T, group_ids_T=batch.group_ids_T,
                   factors_T=batch.factors_T, valid_T=batch.valid_T, hacked_T=batch.hacked_T,
                   grading_ok_G=batch.grading_ok_G, adjustments_T=batch.adjustments_T)


@flax.struct.dataclass
class AdvantageOutput:
    """Per-trajectory advantages and per-group diagnostics of one batch."""
    advantages: jax.Array                # f32[T] final: A' plus centred adjustments
    outcome_advantages: jax.Array        # f32[T] A = r - p (0 for invalid / non-mixed)
    redistributed_advantages: jax.Array  # f32[T] A' after cap and re-centre, no adjustments
    effective_rewards: jax.Array         # f32[T] binary outcome after hack zeroing; 0 if invalid
    factors_used: jax.Array              # f32[T] factor after the fallback (passes of mixed
                                         #        groups); 1 elsewhere
    lam: jax.Array                       # f32[G] lambda applied (1 where not applicable)
    capped: jax.Array                    # bool[G]
    mixed: jax.Array                     # bool[G]
    fallback: jax.Array                  # bool[G]
    pass_rate: jax.Array                 # f32[G] p_g = k_g / n_g (0 for empty groups)
    num_valid: jax.Array                 # i32[G] n_g
    pos_credit_before: jax.Array         # f32[G] sum of A over passes (mixed groups)
    pos_credit_after: jax.Array          # f32[G] sum of A' over passes
    neg_credit: jax.Array                # f32[G] sum of A' over valid failures (<= 0)
    # With per-trajectory weights W (`weights=`; None without them):
    token_credit: Optional[jax.Array] = None          # f32[G] sum over valid members of W A'
    token_outcome_credit: Optional[jax.Array] = None  # f32[G] sum over valid members of W A


@flax.struct.dataclass
class GroupStats:
    """What every mode shares: membership, outcome statistics and the fallback-resolved factors."""
    member_T: jax.Array     # bool: valid with an in-range group id
    pass_T: jax.Array       # bool: member whose outcome (after hack zeroing) is 1
    gid_T: jax.Array        # int32: group id, clipped so gathers are always in range
    n_G: jax.Array          # f32: valid members
    k_G: jax.Array          # f32: passes
    mixed_G: jax.Array      # bool: 0 < k < n
    p_G: jax.Array          # f32: pass rate
    A_T: jax.Array          # f32: outcome advantage r - p in mixed groups, else 0
    f_T: jax.Array          # f32: factor after the fallback for passes of mixed groups, else 1
    fallback_G: jax.Array   # bool


def segment_sum(x_T: jax.Array, gid_T: jax.Array, num_groups: int) -> jax.Array:
    """Sum of `x_T` per group (callers mask non-members to 0 first)."""
    return jax.ops.segment_sum(x_T, gid_T, num_segments=num_groups)


def _check_array(name: str, x: jax.typing.ArrayLike, kind: str, shape: tuple):
    x = jnp.asarray(x)
    if x.ndim != len(shape):
        raise ValueError(f"{name} must have rank {len(shape)} (shape {shape}), got {x.shape}")
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
    ok = {"float": jnp.issubdtype(x.dtype, jnp.floating),
          "int": jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.bool_,
          "bool": x.dtype == jnp.bool_}[kind]
    if not ok:
        raise TypeError(f"{name} must have a {kind} dtype, got {x.dtype}")
    return x


def validate_inputs(rewards: jax.typing.ArrayLike, group_ids: jax.typing.ArrayLike,
                    factors: jax.typing.ArrayLike, valid: jax.typing.ArrayLike,
                    hacked: jax.typing.ArrayLike, grading_ok: jax.typing.ArrayLike, *,
                    num_groups: int, lam_cap: float = 1.5, mode: str = "sum_preserving",
                    adjustments: Optional[jax.typing.ArrayLike] = None,
                    weights: Optional[jax.typing.ArrayLike] = None
                    ) -> tuple[GroupOutcomes, Optional[jax.Array]]:
    """Trace-time checks of ranks, shapes, dtypes and static options.

    Returns:
      (outcomes as jnp arrays, weights as a jnp array or None).
    Raises:
      ValueError / TypeError naming the offending argument.
    """
    if (isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral)
            or num_groups < 1):
        raise ValueError(f"num_groups must be a static Python int >= 1, got {num_groups!r}")
    if isinstance(lam_cap, bool) or not isinstance(lam_cap, numbers.Real):
        raise TypeError(f"lam_cap must be a static Python float, got {type(lam_cap).__name__}")
    if not 1.0 <= float(lam_cap) < float("inf"):
        raise ValueError(f"lam_cap must be finite and >= 1 (lambda >= 1 always), got {lam_cap!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode in WEIGHTED_MODES and weights is None:
        raise ValueError(f"weights: mode {mode!r} needs each trajectory's token weight (the sum "
                         "of its tokens' aggregation weights), got None")
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have rank 1 (shape [T]), got shape {rewards.shape}")
    t = rewards.shape
    w = None if weights is None else _check_array("weights", weights, "float", t)
    return GroupOutcomes(
        rewards_T=_check_array("rewards", rewards, "float", t),
        group_ids_T=_check_array("group_ids", group_ids, "int", t),
        factors_T=_check_array("factors", factors, "float", t),
        valid_T=_check_array("valid", valid, "bool", t),
        hacked_T=_check_array("hacked", hacked, "bool", t),
        grading_ok_G=_check_array("grading_ok", grading_ok, "bool", (num_groups,)),
        adjustments_T=(None if adjustments is None
                       else _check_array("adjustments", adjustments, "float", t))), w


def validated(o: GroupOutcomes, lam_cap: float, mode: str, weights: Optional[jax.Array] = None
              ) -> tuple[GroupOutcomes, Optional[jax.Array]]:
    """`validate_inputs` on a `GroupOutcomes` struct."""
    return validate_inputs(o.rewards_T, o.group_ids_T, o.factors_T, o.valid_T, o.hacked_T,
                           o.grading_ok_G, num_groups=o.num_groups, lam_cap=lam_cap, mode=mode,
                           adjustments=o.adjustments_T, weights=weights)


def group_stats(o: GroupOutcomes, *, use_factors: bool = True,
                std_norm: bool = False) -> GroupStats:
    """Rules 1-5: exclusion, hack zeroing, mixed groups, outcome advantages, grading fallback.

    Inputs are validated arrays (see `validate_inputs`). With `use_factors=False` (binary mode)
    no factor is read and no group falls back. With `std_norm` the outcome advantage of a mixed
    group is divided by its rewards' standard deviation plus STD_EPS (verl's
    norm_adv_by_std_in_grpo; SPEC rule 4): a positive per-group scale.
    """
    G = o.num_groups
    group_ids, valid, hacked, rewards = o.group_ids_T, o.valid_T, o.hacked_T, o.rewards_T
    factors, grading_ok = o.factors_T, o.grading_ok_G
    gid = group_ids.astype(jnp.int32)
    member = valid & (gid >= 0) & (gid < G)   # out-of-range ids would be dropped by segment ops
    gid = jnp.where(member, gid, 0)
    passed = member & ~hacked & (rewards > 0.5)
    n = segment_sum(member.astype(jnp.float32), gid, G)
    k = segment_sum(passed.astype(jnp.float32), gid, G)
    mixed = (k > 0) & (k < n)
    p = k / jnp.maximum(n, 1.0)
    in_mixed = member & mixed[gid]
    A = jnp.where(in_mixed, passed.astype(jnp.float32) - p[gid], 0.0)
    if std_norm:
        # torch.std as verl takes it (n - 1): sum_i (r_i - p)^2 = n p (1 - p) for 0/1 rewards.
        std = jnp.sqrt(n * p * (1.0 - p) / jnp.maximum(n - 1.0, 1.0))
        A = A / (std[gid] + STD_EPS)
    if use_factors:
        # Select before computing: a failure's factor (maybe NaN) never enters arithmetic.
        f_sel = jnp.where(passed, factors.astype(jnp.float32), 1.0)
        bad = passed & ~((f_sel > 0.0) & (f_sel <= 1.0))   # NaN fails both comparisons
        any_bad = segment_sum(bad.astype(jnp.float32), gid, G) > 0
        fallback = mixed & (~grading_ok | any_bad)
        # Non-mixed groups never fall back, so their factors must not be read either.
        f = jnp.where(passed & in_mixed & ~fallback[gid], f_sel, 1.0)
    else:
        fallback = jnp.zeros((G,), jnp.bool_)
        f = jnp.ones_like(A)
    return GroupStats(member_T=member, pass_T=passed, gid_T=gid, n_G=n, k_G=k, mixed_G=mixed,
                      p_G=p, A_T=A, f_T=f, fallback_G=fallback)


def unit_weight_fallback(st: GroupStats, weights_T: jax.Array, num_groups: int) -> jax.Array:
    """W~: members' weights, except that a group whose passes all weigh 0 uses 1 for every
    member (it then behaves as sum_preserving); 0 for non-members. Selected before any
    arithmetic, so a non-member's weight (maybe NaN) is never read."""
    W = jnp.where(st.member_T, weights_T.astype(jnp.float32), 0.0)
    pass_mass = segment_sum(jnp.where(st.pass_T, W, 0.0), st.gid_T, num_groups)
    return jnp.where(st.member_T, jnp.where((pass_mass > 0)[st.gid_T], W, 1.0), 0.0)


def _redistribute(st: GroupStats, *, num_groups: int, lam_cap: float, mode: str,
                  weights_T: Optional[jax.Array] = None):
    """Rules 6-8 and the length-aware mode: returns (A'_T, lam_G, capped_G)."""
    G, gid, A, f = num_groups, st.gid_T, st.A_T, st.f_T
    no_cap = jnp.zeros((G,), jnp.bool_)
    if mode == "binary":
        return A, jnp.ones((G,), jnp.float32), no_cap
    if mode == "downweight_only":
        return jnp.where(st.pass_T, f * A, A), jnp.ones((G,), jnp.float32), no_cap
    if mode == "length_aware":
        return _redistribute_weighted(st, unit_weight_fallback(st, weights_T, G), G, lam_cap)
    F = segment_sum(jnp.where(st.pass_T, f, 0.0), gid, G)
    # lambda = k / sum f > cap  <=>  mean pass factor < 1 / cap; no division needed to decide.
    capped = st.mixed_G & (lam_cap * F < st.k_G)
    lam_raw = st.k_G / jnp.where(F > 0, F, 1.0)
    lam = jnp.where(st.mixed_G, jnp.minimum(lam_raw, lam_cap), 1.0)
    A1 = jnp.where(st.pass_T, lam[gid] * f * A, A)
    # Re-centre capped groups so they keep zero mean (conservation no longer holds there).
    mean = segment_sum(jnp.where(st.member_T, A1, 0.0), gid, G) / jnp.maximum(st.n_G, 1.0)
    A2 = jnp.where(st.member_T & capped[gid], A1 - mean[gid], A1)
    return A2, lam.astype(jnp.float32), capped


def _redistribute_weighted(st: GroupStats, W_T: jax.Array, G: int, lam_cap: float):
    """The length-aware mode (docs/advantage.md section 9): lambda preserves the weighted
    positive credit, sum_pass W A' = sum_pass W A, i.e. lambda = 1 / (weighted mean pass
    factor); a capped group is shifted so that sum_valid W A' = sum_valid W A still holds."""
    gid, A, f = st.gid_T, st.A_T, st.f_T
    K_w = segment_sum(jnp.where(st.pass_T, W_T, 0.0), gid, G)
    F_w = segment_sum(jnp.where(st.pass_T, W_T * f, 0.0), gid, G)
    capped = st.mixed_G & (lam_cap * F_w < K_w)
    lam_raw = K_w / jnp.where(F_w > 0, F_w, 1.0)
    lam = jnp.where(st.mixed_G, jnp.minimum(lam_raw, lam_cap), 1.0)
    A1 = jnp.where(st.pass_T, lam[gid] * f * A, A)
    moved = segment_sum(jnp.where(st.member_T, W_T * (A1 - A), 0.0), gid, G)
    mass = segment_sum(W_T, gid, G)
    shift = moved / jnp.where(mass > 0, mass, 1.0)
    A2 = jnp.where(st.member_T & capped[gid], A1 - shift[gid], A1)
    return A2, lam.astype(jnp.float32), capped


def _advantages(x: GroupOutcomes, *, lam_cap: float, mode: str, std_norm: bool = False,
                weights: Optional[jax.Array] = None):
    """The computation behind `gagar_advantages` on validated arrays; also returns the stats."""
    G = x.num_groups
    st = group_stats(x, use_factors=mode != "binary", std_norm=std_norm)
    A2, lam, capped = _redistribute(st, num_groups=G, lam_cap=float(lam_cap), mode=mode,
                                    weights_T=weights)
    gid, in_mixed = st.gid_T, st.member_T & st.mixed_G[st.gid_T]
    final = A2
    if x.adjustments_T is not None:
        # Rule 9: adjustments are centred on their own and never enter lambda or the cap.
        c = jnp.where(in_mixed, x.adjustments_T.astype(jnp.float32), 0.0)
        c_mean = segment_sum(c, gid, G) / jnp.maximum(st.n_G, 1.0)
        final = A2 + jnp.where(in_mixed, c - c_mean[gid], 0.0)
    fail = st.member_T & ~st.pass_T
    out = AdvantageOutput(
        advantages=final, outcome_advantages=st.A_T, redistributed_advantages=A2,
        effective_rewards=st.pass_T.astype(jnp.float32), factors_used=st.f_T,
        lam=lam, capped=capped, mixed=st.mixed_G, fallback=st.fallback_G, pass_rate=st.p_G,
        num_valid=st.n_G.astype(jnp.int32),
        pos_credit_before=segment_sum(jnp.where(st.pass_T, st.A_T, 0.0), gid, G),
        pos_credit_after=segment_sum(jnp.where(st.pass_T, A2, 0.0), gid, G),
        neg_credit=segment_sum(jnp.where(fail, A2, 0.0), gid, G),
    )
    if weights is not None:
        W = jnp.where(st.member_T, weights.astype(jnp.float32), 0.0)
        out = out.replace(token_credit=segment_sum(W * A2, gid, G),
                          token_outcome_credit=segment_sum(W * st.A_T, gid, G))
    return out, st


def gagar_advantages(rewards: jax.typing.ArrayLike, group_ids: jax.typing.ArrayLike,
                     factors: jax.typing.ArrayLike, valid: jax.typing.ArrayLike,
                     hacked: jax.typing.ArrayLike, grading_ok: jax.typing.ArrayLike, *,
                     num_groups: int, lam_cap: float = 1.5, mode: str = "sum_preserving",
                     adjustments: Optional[jax.Array] = None,
                     std_norm: bool = False,
                     weights: Optional[jax.Array] = None) -> AdvantageOutput:
    """Gagar advantages of one batch of groups (docs/advantage.md section 1).

    Args:
      rewards: f32[T] binary test outcome 0/1.
      group_ids: int[T] group index in [0, num_groups) (ignored for invalid members).
      factors: f32[T] quality factor in (0, 1]; read for passes only.
      valid: bool[T] false for infra failures and padding.
      hacked: bool[T] grader-confirmed reliance on a leaked answer (reward forced to 0).
      grading_ok: bool[num_groups] false = grading failed, the group keeps outcome advantages.
      num_groups: static G.
      lam_cap: static lambda_max >= 1.
      mode: "sum_preserving" (Gagar), "downweight_only" (ablation), "binary" (Dr. GRPO) or
        "length_aware" (sum-preserving in token-weighted credit; needs `weights`).
      adjustments: optional f32[T] additive reward adjustments, centred per group and added
        after the redistribution (rule 9).
      std_norm: static; divide each mixed group's outcome advantages by the standard deviation
        of its rewards plus STD_EPS (verl's norm_adv_by_std_in_grpo, for plain GRPO baselines).
      weights: optional f32[T] per-trajectory token weight W_i >= 0: the sum of its trained
        tokens' aggregation weights (what its advantage is multiplied by in the loss's policy
        term at ratio 1). Needed by "length_aware"; in every mode it adds the per-group
        token-weighted credits `token_credit` and `token_outcome_credit` to the output and
        changes nothing else. Without it the output is today's, bit for bit.

    Returns:
      AdvantageOutput; `advantages` is what the loss broadcasts to tokens.
    """
    x, w = validate_inputs(rewards, group_ids, factors, valid, hacked, grading_ok,
                           num_groups=num_groups, lam_cap=lam_cap, mode=mode,
                           adjustments=adjustments, weights=weights)
    return _advantages(x, lam_cap=lam_cap, mode=mode, std_norm=std_norm, weights=w)[0]


def advantages_of(outcomes: GroupOutcomes, *, lam_cap: float = 1.5,
                  mode: str = "sum_preserving", std_norm: bool = False,
                  weights: Optional[jax.Array] = None) -> AdvantageOutput:
    """`gagar_advantages` on a `GroupOutcomes` struct (G = `outcomes.num_groups`)."""
    x, w = validated(outcomes, lam_cap, mode, weights)
    return _advantages(x, lam_cap=lam_cap, mode=mode, std_norm=std_norm, weights=w)[0]


def equivalent_rewards(rewards: jax.typing.ArrayLike, group_ids: jax.typing.ArrayLike,
                       factors: jax.typing.ArrayLike, valid: jax.typing.ArrayLike,
                       hacked: jax.typing.ArrayLike, grading_ok: jax.typing.ArrayLike, *,
                       num_groups: int, lam_cap: float = 1.5,
                       mode: str = "sum_preserving", std_norm: bool = False) -> jax.Array:
    """The shaped reward r' whose per-group mean-centring reproduces A' (INV-8).

    The centring identity needs A' to have zero group mean: it holds in sum_preserving and
    binary modes, not in downweight_only (whose credit is net negative by design); length_aware
    needs weights this function does not take, and is rejected.

    Valid members of mixed groups get `p_g + A'_i`; members of other groups keep their effective
    (hack-zeroed) reward; invalid trajectories get 0. Same arguments as `gagar_advantages`.

    Returns:
      f32[T].
    """
    x, _ = validate_inputs(rewards, group_ids, factors, valid, hacked, grading_ok,
                           num_groups=num_groups, lam_cap=lam_cap, mode=mode)
    out, st = _advantages(x, lam_cap=lam_cap, mode=mode, std_norm=std_norm)
    in_mixed = st.member_T & st.mixed_G[st.gid_T]
    return jnp.where(in_mixed, st.p_G[st.gid_T] + out.redistributed_advantages,
                     out.effective_rewards)


def broadcast_to_tokens(adv_T: jax.Array, traj_index_BxS: jax.Array,
                        loss_mask_BxS: jax.Array) -> jax.Array:
    """Per-token advantages for packed rows (rule 10).

    Args:
      adv_T: f32[T] per-trajectory advantages.
      traj_index_BxS: int[B, S] index of each token's trajectory in [0, T).
      loss_mask_BxS: [B, S] 1 (or True) on model-generated tokens.

    Returns:
      f32[B, S]: `adv_T[traj]` on generated tokens, exactly 0 on prompt, tool and padding tokens.
    """
    adv_T = jnp.asarray(adv_T)
    if adv_T.ndim != 1:
        raise ValueError(f"adv_T must have rank 1 (shape [T]), got shape {adv_T.shape}")
    if not jnp.issubdtype(adv_T.dtype, jnp.floating):
        raise TypeError(f"adv_T must have a float dtype, got {adv_T.dtype}")
    traj_index_BxS = jnp.asarray(traj_index_BxS)
    if traj_index_BxS.ndim != 2:
        raise ValueError(f"traj_index_BxS must have rank 2 (shape [B, S]), "
                         f"got {traj_index_BxS.shape}")
    if not jnp.issubdtype(traj_index_BxS.dtype, jnp.integer):
        raise TypeError(f"traj_index_BxS must have an int dtype, got {traj_index_BxS.dtype}")
    loss_mask_BxS = jnp.asarray(loss_mask_BxS)
    if loss_mask_BxS.shape != traj_index_BxS.shape:
        raise ValueError(f"loss_mask_BxS must have shape {traj_index_BxS.shape}, "
                         f"got {loss_mask_BxS.shape}")
    adv_BxS = jnp.take(adv_T.astype(jnp.float32), traj_index_BxS, mode="clip")
    return jnp.where(loss_mask_BxS.astype(jnp.bool_), adv_BxS, 0.0)
