"""Realistic synthetic feed records for samples, tests and benchmarks.

Each trajectory has the agent layout: a prompt, then alternating model turns (trained,
loss_mask = 1, negative log-probs) and tool-output spans (loss_mask = 0), ending on a model
turn. Groups mix passes, fails, infra errors, hacks, tiers/ranks or direct factors, failed
gradings, optional routing records and a share of uniform-outcome groups.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from gagar_jax.feed import packed, schema

TIERS = ("strong", "intermediate", "defective")


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """Knobs of the generator (defaults fit configs/tiny_cpu.py)."""

    vocab_size: int = 256
    min_group: int = 4
    max_group: int = 6
    min_len: int = 24
    max_len: int = 110
    p_uniform: float = 0.12          # all-pass or all-fail groups (dropped by dynamic sampling)
    p_infra: float = 0.05            # per trajectory
    p_hacked: float = 0.06           # per pass
    p_grading_failed: float = 0.05   # per group
    p_direct_factor: float = 0.15    # per group: factors instead of tiers/ranks
    p_routed: float = 0.25           # per group: routing records present
    num_moe_layers: int = 2
    top_k: int = 2
    num_experts: int = 8
    groups_per_step: int = 6         # policy_version advances once per this many groups
    # routed_experts as nested lists ("list"), or compact ("packed": `schema.PackedArray`, the
    # ids drawn with a fast generator: K distinct experts per token and layer, evenly strided).
    routed_encoding: str = "list"
    # tokens and logprobs as lists ("list") or compact ("packed": int32 / float32 arrays).
    token_encoding: str = "list"


def _trajectory(rng: np.random.Generator, spec: SyntheticSpec, tid: str, outcome: str,
                routed: bool) -> schema.Trajectory:
    n = int(rng.integers(spec.min_len, spec.max_len + 1))
    prompt = int(rng.integers(6, max(7, n // 3)))
    mask = np.zeros(n, np.int64)
    pos, model_turn = prompt, True
    while pos < n:
        span = int(rng.integers(3, 16))
        if model_turn:
            mask[pos:pos + span] = 1
        pos += span
        model_turn = not model_turn
    mask[-3:] = 1                    # the final turn is the model's
    tokens = rng.integers(0, spec.vocab_size, n)
    logprobs = np.where(mask == 1, -np.round(rng.exponential(0.7, n) + 1e-3, 4), 0.0)
    rexp = None
    if routed and spec.routed_encoding == "packed":
        n_gen, E, K = int(mask.sum()), spec.num_experts, spec.top_k
        dt = np.uint8 if E <= 256 else np.uint16      # small temporaries for long trajectories
        first = rng.integers(0, E, (n_gen, spec.num_moe_layers, 1), dtype=np.uint32)
        rexp = packed.pack(((first + np.arange(K, dtype=np.uint32) * (E // K)) % E).astype(dt))
    elif routed:
        n_gen = int(mask.sum())
        rexp = np.stack([rng.permutation(spec.num_experts)[:spec.top_k]
                         for _ in range(n_gen * spec.num_moe_layers)])
        rexp = rexp.reshape(n_gen, spec.num_moe_layers, spec.top_k).tolist()
    compact = spec.token_encoding == "packed"
    return schema.Trajectory(
        trajectory_id=tid, loss_mask=mask.tolist(), outcome=outcome, routed_experts=rexp,
        tokens=packed.pack_array(tokens, "int32") if compact else tokens.tolist(),
        logprobs=(packed.pack_array(logprobs, "float32") if compact
                  else [float(x) for x in logprobs]),
        adjustment=float(-round(0.1 * max(0, n - 0.9 * spec.max_len) / spec.max_len, 4)))


def make_group(rng: np.random.Generator, index: int,
               spec: SyntheticSpec = SyntheticSpec()) -> schema.Group:
    """One synthetic group (`index` names it and sets its policy_version)."""
    size = int(rng.integers(spec.min_group, spec.max_group + 1))
    if rng.random() < spec.p_uniform:
        outcomes = [("pass" if rng.random() < 0.5 else "fail")] * size
    else:
        k = int(rng.integers(1, size))
        outcomes = ["pass"] * k + ["fail"] * (size - k)
        rng.shuffle(outcomes)
    outcomes = ["infra_error" if rng.random() < spec.p_infra else o for o in outcomes]
    routed = rng.random() < spec.p_routed
    direct = rng.random() < spec.p_direct_factor
    trajs = []
    for j, outcome in enumerate(outcomes):
        t = _trajectory(rng, spec, f"g{index:06d}-t{j}", outcome, routed)
        if outcome == "infra_error":
            head = t.tokens[:5] if isinstance(t.tokens, list) else [1, 2, 3, 4, 5]
            t = msgspec.structs.replace(t, tokens=head, loss_mask=[0] * 5,
                                    logprobs=[0.0] * 5, routed_experts=None)
        if outcome == "pass":
            if direct:
                quality = schema.Quality(factor=float(np.round(rng.uniform(0.3, 1.0), 3)))
            else:
                quality = schema.Quality(tier=TIERS[int(rng.choice(3, p=[0.4, 0.4, 0.2]))],
                                         rank=int(rng.integers(1, 4)))
            t = msgspec.structs.replace(
                t, quality=quality, hacked=bool(rng.random() < spec.p_hacked)
            )
        trajs.append(t)
    failed = rng.random() < spec.p_grading_failed
    grading = schema.Grading(
        status="failed" if failed else "ok",
        grader="synthetic-grader-v1",
        evidence="grader timed out"
        if failed
        else {"summary": f"ranked {outcomes.count('pass')} passes"},
    )
    return schema.Group(
        schema_version=schema.SCHEMA_VERSION, group_id=f"g{index:06d}",
        task_id=f"task-{int(rng.integers(0, 10_000)):05d}",
        policy_version=max(0, index // spec.groups_per_step - 1), grading=grading,
        trajectories=trajs)


def make_groups(num_groups: int, seed: int = 0, spec: SyntheticSpec = SyntheticSpec(),
                start: int = 0) -> list:
    """`num_groups` synthetic groups, deterministic in `seed` (indices from `start`)."""
    rng = np.random.default_rng(seed)
    return [make_group(rng, start + i, spec) for i in range(num_groups)]


def malformed_records(seed: int = 0) -> list:
    """One record per validation reason that a producer could get wrong (every reason but
    `record_too_large`, `duplicate_group_id`, `group_too_large` and `invalid_record`, which
    depend on the config, on other records or on a learner bug).

    Returns:
      A list of (expected reason, encoded record, encoding). msgpack is used because JSON
      cannot carry the non-finite numbers some cases need.
    """
    import msgspec
    spec = dataclasses.replace(SyntheticSpec(), p_uniform=0.0, p_infra=0.0, p_routed=0.0)
    base = schema.to_builtins(make_group(np.random.default_rng(seed), 999_000, spec))
    out = []

    def variant(reason: str, edit: Callable[[dict, dict], Any]):
        rec = msgspec.msgpack.decode(msgspec.msgpack.encode(base))
        rec["group_id"] = f"bad-{reason}"
        edit(rec, rec["trajectories"][0])
        out.append((reason, msgspec.msgpack.encode(rec), "msgpack"))

    variant("schema", lambda r, t: r.pop("task_id"))
    variant("unknown_outcome", lambda r, t: t.update(outcome="timeout"))
    variant("unsupported_schema_version", lambda r, t: r.update(schema_version=99))
    variant("length_mismatch", lambda r, t: t.update(logprobs=t["logprobs"][:-1]))
    variant("bad_loss_mask", lambda r, t: t.update(loss_mask=[2] + t["loss_mask"][1:]))
    variant("token_out_of_vocab", lambda r, t: t["tokens"].__setitem__(1, 10**6))
    variant("non_finite", lambda r, t: t.update(adjustment=float("inf")))
    variant("bad_quality", lambda r, t: t.update(quality={"tier": "strong"}))
    variant("trajectory_too_long", lambda r, t: t.update(
        tokens=t["tokens"] * 9, loss_mask=t["loss_mask"] * 9, logprobs=t["logprobs"] * 9,
        routed_experts=None))
    variant("no_generated_tokens", lambda r, t: t.update(
        loss_mask=[0] * len(t["tokens"]), logprobs=[0.0] * len(t["tokens"]),
        routed_experts=None))
    variant("routed_experts_shape", lambda r, t: t.update(routed_experts=[[[0]]]))

    def short_payload(t: dict):      # a packed array with fewer bytes than its shape needs
        n_gen = sum(t["loss_mask"])
        p = packed.pack(np.zeros((n_gen, spec.num_moe_layers, spec.top_k), np.int64), "uint8")
        t["routed_experts"] = schema.to_builtins(msgspec.structs.replace(p, b64=p.b64[:-4]))

    variant("bad_encoding", lambda r, t: short_payload(t))
    variant("duplicate_trajectory_id", lambda r, t: r["trajectories"][1].update(
        trajectory_id=t["trajectory_id"]))
    variant("no_valid_trajectory", lambda r, t: [x.update(outcome="infra_error")
                                                 for x in r["trajectories"]])
    variant("too_many_trajectories", lambda r, t: r.update(trajectories=r["trajectories"] * 5))
    variant("negative_policy_version", lambda r, t: r.update(policy_version=-1))
    variant("policy_version_spans_unsorted", lambda r, t: t.update(
        policy_version_spans=[[2, r["policy_version"]], [1, r["policy_version"]]]))
    variant("policy_version_out_of_range", lambda r, t: t.update(
        policy_version_spans=[[0, r["policy_version"]], [len(t["tokens"]), r["policy_version"]]]))
    variant("policy_version_spans_empty", lambda r, t: t.update(policy_version_spans=[]))
    variant("policy_version_newer_than_group", lambda r, t: t.update(
        policy_versions=[r["policy_version"] + 1] * len(t["tokens"])))
    variant("from_the_future", lambda r, t: r.update(policy_version=10**6))
    variant("id_too_long", lambda r, t: t.update(trajectory_id="t" * (schema.MAX_ID_CHARS + 1)))
    out.append(("unparseable", b'{"schema_version": 1, "group_id": "trunc', "json"))
    deep = b"[" * 20_000 + b"]" * 20_000       # an unknown field nested past any decoder
    out.append(("too_deeply_nested", b'{"junk": ' + deep + b', "schema_version": 1}', "json"))
    return out
