"""Load and publish throughput (GB/s) of the sharded weights I/O, for 1 and 2 processes on CPU.

    python scripts/bench_weights_io.py [--mb 200] [--dir /tmp/bench_wio] [--cold [--no-advise]]

Writes a random Qwen3-MoE checkpoint of about `--mb` MB (float32, NumPy, no JAX init), then for
1 process x 8 CPU devices and 2 processes x 4 CPU devices (gloo) times
`hf.from_pretrained(..., mesh=fsdp 2 x expert 4)` (each process reads only its shards) and one
`publish.Publisher` publish in float32 (reshard, device-to-host, every process writing its share),
and prints one JSON line per process count. GB/s = checkpoint bytes / slowest process's seconds.
On 2 processes sharing one machine's cores, CPU time is shared too: the figure shows that the
work divides, not what a pod's hosts (each with its own disk or network) reach.

`--cold`: bytes each process reads from storage while loading, with a cold page cache, instead of
publishing. Every process evicts the checkpoint's pages (`posix_fadvise(POSIX_FADV_DONTNEED)`)
and loads in turn (process p starts after p - 1 finished, so no process finds pages another one
brought in), reading `read_bytes` of /proc/self/io before and after. A control first reads the
whole file cold and must count about its size: on file systems where `read_bytes` stays 0
(tmpfs, overlay) the script says so and reports no figure. `--no-advise` loads without the
reader's madvise calls (`safetensors.advise`): the reads as they were before MADV_RANDOM.
`pages_touched_fraction_per_process` is the floor for any page-cache reader: the 4 KiB pages the
process's boxes touch (a box cutting a row of 1 KiB in half still needs all of its pages).
The scratch directory must be on a real disk (not /dev/shm).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import time

from benchutil import timed_call

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


def read_bytes() -> int:
    """This process's bytes read from storage so far (/proc/self/io `read_bytes`)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def evict(directory: str) -> None:
    """Drops the page cache of every file in `directory` (clean pages: written files fsync'ed)."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def control_read(directory: str) -> tuple:
    """(bytes counted, bytes in the files) for a cold full read of `directory`."""
    evict(directory)
    before, total = read_bytes(), 0
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(1 << 22):
                total += len(chunk)
    return read_bytes() - before, total


def cold_load(ckpt: str, mesh, nproc: int, pid: int, fast: dict) -> dict:
    """Loads `ckpt` with a cold cache after process pid - 1 has finished its own cold load."""
    from flax import nnx

    from gagar_jax.distributed import kv_client
    from gagar_jax.hf import api as hf
    client = kv_client() if nproc > 1 else None
    if pid > 0:
        client.blocking_key_value_get(f"bench_cold/{pid - 1}", 600_000)
    evict(ckpt)
    before = read_bytes()
    _, load_s = timed_call(lambda: nnx.state(hf.from_pretrained(ckpt, mesh=mesh, **fast)[0]))
    row = {"load_s": load_s, "read_bytes": read_bytes() - before}
    if client is not None:
        client.key_value_set(f"bench_cold/{pid}", "done")
    return row


def worker(ckpt: str, out: str, nproc: int, pid: int, port: int, mode: str = "") -> None:
    import jax
    if nproc > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                                   process_id=pid)
    import types

    from flax import nnx

    from gagar_jax import sharding
    from gagar_jax.hf import api as hf
    from gagar_jax.hf import safetensors
    from gagar_jax.run import publish

    mesh = sharding.make_mesh(types.SimpleNamespace(data=1, fsdp=2, expert=-1, tensor=1))
    if mode:
        pages = set()   # (file, page index) of every page the boxes touch: the floor for reads
        real_read = getattr(safetensors, "_read_local", None)   # the bench counts its pages

        def counted(path, name, base, nbytes, shape, box, dt, out, offsets, run):
            for start, length in zip(*safetensors.page_ranges(base, offsets, run), strict=True):
                pages.update((path, i) for i in range(start // mmap.PAGESIZE,
                                                      (start + length) // mmap.PAGESIZE))
            real_read(path, name, base, nbytes, shape, box, dt, out, offsets, run)
        if hasattr(safetensors, "_read_local"):   # absent in readers before MADV_RANDOM
            safetensors._read_local = counted
        if mode == "cold-no-advise":
            safetensors.advise = lambda *a: None
        row = cold_load(ckpt, mesh, nproc, pid, FAST)
        row["pages_touched_bytes"] = len(pages) * mmap.PAGESIZE if pages else None
        print(json.dumps(row), flush=True)
        return
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


def _run(a, ckpt: str, nproc: int, mode: str) -> list:
    port, procs = _port(), []
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO,
               XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // nproc}")
    for pid in range(nproc):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--worker", ckpt, os.path.join(a.dir, f"pub{nproc}"),
             str(nproc), str(pid), str(port), mode], env=env, stdout=subprocess.PIPE,
            text=True))
    rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"bench_weights_io: a {nproc}-process run failed")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=200.0, help="checkpoint size (MB, float32)")
    ap.add_argument("--dir", default="/tmp/bench_weights_io", help="scratch directory")
    ap.add_argument("--cold", action="store_true",
                    help="bytes read per process with a cold page cache (no publishing)")
    ap.add_argument("--no-advise", action="store_true",
                    help="with --cold: load without the reader's madvise (the reads before it)")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], a.worker[1], *map(int, a.worker[2:5]), *a.worker[5:])
        return
    ckpt = os.path.join(a.dir, "ckpt")
    nbytes = make_checkpoint(ckpt, a.mb)
    if a.cold:
        counted, total = control_read(ckpt)
        control = {"control_full_read_bytes": counted, "files_bytes": total}
        if counted < 0.9 * total:
            print(json.dumps({**control, "verdict": "read_bytes does not count on this file "
                              "system (tmpfs, overlay?): no per-process figure"}))
            return
        mode = "cold-no-advise" if a.no_advise else "cold"
        for nproc in (1, 2):
            rows = _run(a, ckpt, nproc, mode)
            print(json.dumps({
                "processes": nproc, "mode": mode, "checkpoint_bytes": nbytes, **control,
                "read_bytes_per_process": [r["read_bytes"] for r in rows],
                "read_fraction_per_process": [round(r["read_bytes"] / nbytes, 3) for r in rows],
                "pages_touched_fraction_per_process": [
                    r["pages_touched_bytes"] and round(r["pages_touched_bytes"] / nbytes, 3)
                    for r in rows],
                "load_s_per_process": [round(r["load_s"], 2) for r in rows]}))
        return
    for nproc in (1, 2):
        rows = _run(a, ckpt, nproc, "")
        load_s = max(r["load_s"] for r in rows)
        pub_s = max(r["publish_s"] for r in rows)
        print(json.dumps({
            "processes": nproc, "checkpoint_gb": nbytes / 1e9,
            "load_gb_per_s": nbytes / 1e9 / load_s, "publish_gb_per_s": nbytes / 1e9 / pub_s,
            "publish_blocking_s": max(r["publish_host_s"] for r in rows),
            "written_per_process_gb": [r["written"] / 1e9 for r in rows]}))


if __name__ == "__main__":
    main()
