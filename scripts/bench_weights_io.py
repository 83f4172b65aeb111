"""Load and publish throughput (GB/s) of the sharded weights I/O, for 1 and 2 processes on CPU.

    python scripts/bench_weights_io.py [--mb 200] [--dir /tmp/bench_wio]

Writes a random Qwen3-MoE checkpoint of about `--mb` MB (float32, NumPy, no JAX init), then for
1 process x 8 CPU devices and 2 processes x 4 CPU devices (gloo) times
`hf.from_pretrained(..., mesh=fsdp 2 x expert 4)` (each process reads only its shards) and one
`publish.Publisher` publish in float32 (reshard, device-to-host, every process writing its share),
and prints one JSON line per process count. GB/s = checkpoint bytes / slowest process's seconds.
On 2 processes sharing one machine's cores, CPU time is shared too: the figure shows that the
work divides, not what a pod's hosts (each with its own disk or network) reach.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = dict(expert_backend="dense", attention="plain")


def _hf_config(mb: float) -> dict:
    layers = max(2, int(round(mb / 25)))   # ~25 MB of float32 experts per MoE layer
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=4096,
                hidden_size=256, intermediate_size=512, num_hidden_layers=layers + 1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
                norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
                rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                hidden_act="silu")


def make_checkpoint(path: str, mb: float) -> int:
    import jax
    import numpy as np
    from flax import nnx

    from gagar_jax import sharding
    from gagar_jax.hf import api as hf
    from gagar_jax.hf import save as hf_save
    from gagar_jax.hf.safetensors import write_safetensors
    from gagar_jax.model.transformer import Transformer

    cfg = hf.config_from_hf(_hf_config(mb), **FAST)
    _, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    leaves = {
        sharding.leaf_path(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal(t.shape, dtype=np.float32) * np.float32(0.05)
               for n, t in hf_save.plan_save(leaves, cfg, 1, "float32").tensors.items()}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf.config_to_hf(cfg, "float32"), f)
    return write_safetensors(os.path.join(path, "model.safetensors"), tensors)


def worker(ckpt: str, out: str, nproc: int, pid: int, port: int) -> None:
    import jax
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                                   process_id=pid)
    import types

    from flax import nnx

    from gagar_jax import sharding
    from gagar_jax.hf import api as hf
    from gagar_jax.run import publish

    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=-1, tensor=1))
    t0 = time.perf_counter()
    model, _ = hf.from_pretrained(ckpt, mesh=mesh, **FAST)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    pub = publish.Publisher(out, dtype="float32")
    pub.publish(model, 0)        # first publish: compiles the reshards
    pub.close()
    t0 = time.perf_counter()
    pub.publish(model, 1)
    host_s = time.perf_counter() - t0   # what training waits for
    pub.close()
    publish_s = time.perf_counter() - t0
    print(json.dumps({"load_s": load_s, "publish_s": publish_s, "publish_host_s": host_s,
                      "written": pub.last_bytes}), flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="checkpoint size (MB, float32)")
    ap.add_argument("--dir", default="/tmp/bench_weights_io", help="scratch directory")
    ap.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], *map(int, a.worker[2:]))
        return
    ckpt = os.path.join(a.dir, "ckpt")
    nbytes = make_checkpoint(ckpt, a.mb)
    for nproc in (1, 2):
        port, procs = _port(), []
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}")
        for pid in range(nproc):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", ckpt, os.path.join(a.dir, f"pub{nproc}"),
                 str(nproc), str(pid), str(port)], env=env, stdout=subprocess.PIPE, text=True))
        rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
        if any(p.returncode for p in procs):
            sys.exit(f"bench_weights_io: a {nproc}-process run failed")
        load_s = max(r["load_s"] for r in rows)
        pub_s = max(r["publish_s"] for r in rows)
        print(json.dumps({
            "processes": nproc, "checkpoint_gb": nbytes / 1e9,
            "load_gb_per_s": nbytes / 1e9 / load_s, "publish_gb_per_s": nbytes / 1e9 / pub_s,
            "publish_blocking_s": max(r["publish_host_s"] for r in rows),
            "written_per_process_gb": [r["written"] / 1e9 for r in rows]}))


if __name__ == "__main__":
    main()
