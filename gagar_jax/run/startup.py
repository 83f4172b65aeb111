"""Cross-section rules, checked before anything compiles: each failure is one `ConfigError` line.

    check_run(step_cfg, feed_cfg, train_cfg)                  # every run
    check_layout(step_cfg, feed_cfg, mesh, process_count)    # every run
    check_hf_dir(path, "train.init_from", step_cfg.model, feed_cfg)  # fresh runs only

A section's own rules live in its dataclass (`FeedConfig.__post_init__`, `TrainConfig`, ...);
here are the rules that tie sections together: the feed's batch against the mesh and the step's
splits, expert parallelism against the expert count, and an outside checkpoint (`init_from`,
`reference_from`) against the model, read from its `config.json` alone (no tensor is opened).
The CLI turns a `ConfigError` into one line and exit code 2.
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING

from etils import epath

from gagar_jax.config import ConfigError
from gagar_jax.distributed import is_remote
from gagar_jax.hf import families as hf_families
from gagar_jax.hf.config_json import config_from_hf
from gagar_jax.kernels.experts import registry as expert_registry
from gagar_jax.sharding import axis_size, mesh_axes

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from gagar_jax.config import TrainConfig
    from gagar_jax.feed.config import FeedConfig
    from gagar_jax.model.config import ModelConfig
    from gagar_jax.run.step import StepConfig

# ModelConfig fields that change the model's math (the rest are runtime choices or loss weights).
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "moe_intermediate_size", "intermediate_size", "num_experts", "top_k", "num_dense_layers",
    "norm_topk_prob", "router", "rope_theta", "rms_norm_eps", "tie_embeddings", "layer_types",
    "sliding_window", "sliding_kv_heads", "attention_sinks", "value_head_dim",
    "attention_value_scale", "partial_rotary_factor", "sliding_rope_theta", "qk_norm", "n_group",
    "topk_group", "routed_scaling_factor")
EP_BACKENDS = ("ep", "ep_a2a")     # expert backends that shard_map over the expert axis


def check_run(step_cfg: StepConfig, feed_cfg: FeedConfig, train_cfg: TrainConfig, *,
              source_given: bool = False) -> None:
    """The rules that need no mesh: one feed source that exists, a KL reference that is read,
    publishing has a family to write.

    Args:
      step_cfg, feed_cfg, train_cfg: the run's sections.
      source_given: the caller passes its own feed source (`train.run(source=...)`), so neither
        `feed.path` nor `feed.spool_dir` is read.
    Raises:
      ConfigError naming the key.
    """
    if not source_given:
        _check_feed_source(feed_cfg)
    if train_cfg.reference_from and not step_cfg.loss.kl_coef > 0:
        raise ConfigError(f"train.reference_from={train_cfg.reference_from!r} is never read with "
                          f"loss.kl_coef={step_cfg.loss.kl_coef}: set loss.kl_coef > 0, or clear "
                          "train.reference_from")
    try:
        family = hf_families.resolve_family(step_cfg.model)
    except ValueError as e:   # an explicit model.hf_family that cannot express the model
        raise ConfigError(str(e)) from e
    if train_cfg.publish_every and family is None:
        raise ConfigError(f"train.publish_every={train_cfg.publish_every}: "
                          f"{hf_families.export_error(step_cfg.model)}")


def _check_feed_source(feed_cfg: FeedConfig) -> None:
    """Exactly one of feed.path / feed.spool_dir; a file that exists; a spool that exists unless
    feed.spool_create asks for it (object-store spools have no directories: not checked)."""
    path, spool = feed_cfg.path, feed_cfg.spool_dir
    if path and spool:
        raise ConfigError(f"feed.path={path!r} and feed.spool_dir={spool!r} are both set; the "
                          "feed reads one source: clear one of them (e.g. --config.feed.path=)")
    if not path and not spool:
        raise ConfigError("no feed source: set feed.path (a file or glob of shards) or "
                          "feed.spool_dir (a live spool directory)")
    if path and not any(ch in path for ch in "*?[") and not epath.Path(path).exists():
        where = "" if is_remote(path) or os.path.isabs(path) else (
            f" (relative paths resolve against the current directory {os.getcwd()})")
        raise ConfigError(f"feed.path: no such file: {path}{where}")
    if spool and not is_remote(spool) and not feed_cfg.spool_create:
        if not os.path.isdir(spool):
            what = "is not a directory" if os.path.exists(spool) else "does not exist"
            raise ConfigError(f"feed.spool_dir={spool!r} {what}: create it first, or set "
                              "feed.spool_create=true to have the learner create it")


def check_layout(step_cfg: StepConfig, feed_cfg: FeedConfig, mesh: Mesh,
                 process_count: int) -> None:
    """The feed's global batch against the processes, the step's splits and the mesh.

    Args:
      step_cfg: the `StepConfig` (model, mini/micro-batch splits).
      feed_cfg: the `FeedConfig` (rows_per_batch, seq_len, routing_replay).
      mesh: the run's mesh (`sharding.make_mesh`).
      process_count: number of JAX processes.
    Raises:
      ConfigError naming the keys that disagree.
    """
    rows, model = feed_cfg.rows_per_batch, step_cfg.model
    n_ctx = axis_size("seq", mesh)
    # Each process builds the rows its devices hold (`sharding.process_row_block`); without a
    # context axis that is an even split of the rows over the processes.
    if n_ctx == 1 and rows % process_count:
        raise ConfigError(f"feed.rows_per_batch={rows} must divide by the {process_count} "
                          "processes")
    lengths = feed_cfg.buckets or (feed_cfg.seq_len,)
    if any(s % n_ctx for s in lengths):
        raise ConfigError(f"feed.seq_len={feed_cfg.seq_len} (or each of feed.buckets "
                          f"{feed_cfg.buckets}) must divide by mesh.context={n_ctx} "
                          "(rows are split along the sequence over it)")
    splits = step_cfg.mini_batches * step_cfg.micro_batches
    if feed_cfg.buckets:     # micro-batches of bucket_rows rows, one optimizer update
        if step_cfg.mini_batches != 1:
            raise ConfigError(f"feed.buckets needs train.mini_batches = 1, got "
                              f"{step_cfg.mini_batches}")
        splits = rows // feed_cfg.bucket_rows
    if rows % splits:
        raise ConfigError(f"feed.rows_per_batch={rows} must divide by train.mini_batches * "
                          f"train.micro_batches = {step_cfg.mini_batches} * "
                          f"{step_cfg.micro_batches}")
    if feed_cfg.routing_replay and not (model.num_moe_layers and model.top_k):
        raise ConfigError("feed.routing_replay needs a model with MoE layers "
                          f"(model.num_layers={model.num_layers}, "
                          f"model.num_dense_layers={model.num_dense_layers})")
    try:
        backend = expert_registry.resolve(model.expert_backend, mesh, model.num_experts)
    except ValueError as e:
        raise ConfigError(f"model.expert_backend: {e}") from e
    if backend not in EP_BACKENDS or not model.num_moe_layers:
        return
    (expert_axis,) = mesh_axes("expert", mesh) or (None,)
    n_exp = mesh.shape[expert_axis] if expert_axis else 1
    if model.num_experts % n_exp:
        raise ConfigError(f"model.expert_backend={backend!r}: model.num_experts="
                          f"{model.num_experts} must divide by mesh.expert={n_exp}")
    tok_axes = mesh_axes("batch", mesh) + (mesh_axes("seq", mesh) if n_ctx > 1 else ())
    n_tok = math.prod(mesh.shape[a] for a in tok_axes)
    tokens = rows // splits * min(lengths)              # tokens of one micro-batch
    if tokens % n_tok:
        raise ConfigError(f"model.expert_backend={backend!r}: a micro-batch's {tokens} tokens "
                          f"(feed.rows_per_batch / (mini_batches * micro_batches) * feed.seq_len)"
                          f" must divide by the batch mesh axes {tok_axes} ({n_tok} devices)")


def read_hf_config(path: str, what: str) -> dict:
    """`<path>/config.json` as a dict (local or object-store path), or a ConfigError."""
    f = epath.Path(path) / "config.json"
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what}: no config.json in {path}") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what}: unreadable {f}: {e}") from None


def check_hf_dir(path: str, what: str, model_cfg: ModelConfig, feed_cfg: FeedConfig) -> None:
    """An outside HF checkpoint against the configured model and feed, from config.json alone.

    Args:
      path: the checkpoint directory (`train.init_from` / `train.reference_from`).
      what: the config key, for the message.
      model_cfg: the configured `ModelConfig`.
      feed_cfg: the `FeedConfig`: trajectories must fit the checkpoint's positions.
    Raises:
      ConfigError: missing/unreadable config.json, a family we cannot read, an architecture
        field that differs (all listed), or trajectories longer than max_position_embeddings.
    """
    hf = read_hf_config(path, what)
    try:
        ckpt = config_from_hf(hf, sliding_window_convention=model_cfg.sliding_window_convention)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{what}: {path}/config.json: {e}") from None
    differ = [f for f in ARCHITECTURE_FIELDS if getattr(ckpt, f) != getattr(model_cfg, f)]
    if differ:
        raise ConfigError(
            f"{what}: checkpoint architecture does not match the config's model section: "
            f"checkpoint has {', '.join(f'{f}={getattr(ckpt, f)!r}' for f in differ)}; config "
            f"has {', '.join(f'{f}={getattr(model_cfg, f)!r}' for f in differ)}")
    max_pos = hf.get("max_position_embeddings")
    if max_pos and feed_cfg.max_traj_tokens > int(max_pos):
        raise ConfigError(f"feed.max_traj_tokens={feed_cfg.max_traj_tokens} exceeds {what}'s "
                          f"max_position_embeddings={max_pos}")
