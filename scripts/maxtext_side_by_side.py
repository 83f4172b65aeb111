"""Side by side with MaxText 0.2.5 (issue 29): the same model, topology and batch, one measure.

    make side_by_side            # builds .venv-maxtext (MaxText's own Python 3.12 env), runs this
    .venv/bin/python scripts/maxtext_side_by_side.py [--variants default,ring,ring_chunks16] \
        [--gagar_report docs/aot/R.json --gagar_dump DIR | --compile_gagar] [--mem_cap_gb 16] \
        [--until_buffer_assignment ring_chunks8,ring_chunks16]

For each MaxText variant, MaxText's `train_compile` (run in .venv-maxtext as a subprocess, one at
a time, inside a cgroup-v1 memory cap) AOT-compiles a 48-layer `gemma4`-block MoE model with
MiMo-V2-Flash's shapes for v5p-1024 (fsdp 16 x expert 8 x tensor 4, 256 rows x 32768 tokens per
step in 2 gradient-accumulation steps, bf16 compute, fp32 weights and Adam, full remat) with the
XLA dump on. Every column, gagar_jax's included, is measured three ways:
  (a) `memory_analysis()` (arguments + outputs - aliases + temporaries + code), where the compile
      finished; a compile-time HBM OOM gives the compiler's "Used X of Y hbm" instead;
  (b) the buffer assignment (`*buffer-assignment.txt` of the dump): the sum of the allocation
      sizes in HBM (color 0), thread-local ones left out (they are not in memory_analysis
      either); it exists as soon as the compiler got past buffer assignment, so a compile
      killed later (host memory, HBM OOM) still has it;
  (c) XLA's peak live set (`gagar_jax.aot.buffers.peak_buffers`, the live-range dump's peak).
Both sides compile with one TPU compiler: .venv-maxtext holds pyproject's libtpu (`make maxtext`),
and each column records its libtpu version. A variant named in --until_buffer_assignment is
stopped as soon as its dump has the train step's buffer assignment and live ranges ((b) and (c)
are final then; code generation of the chunked variants takes the most time and host memory).
Prints the markdown table and writes docs/aot/maxtext_side_by_side.json (the commit inside).
The config keys used are MODEL_KEYS and VARIANTS below; docs/scaling.md ("Side by side with
MaxText") says what each side cannot express. Stdlib + gagar_jax only.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAXTEXT_PY = os.path.join(REPO, ".venv-maxtext", "bin", "python")
GiB = 2**30
TOPOLOGY = "v5p-1024"           # MaxText's name; gagar_jax's: v5p:8x8x8 (512 chips)
# one cgroup per run of this script: two runs side by side keep their own caps
CGROUP = f"/sys/fs/cgroup/memory/maxtext-{os.getpid()}"

# MiMo-V2-Flash (configs/flash_310b.py) in MaxText 0.2.5's keys (configs/base.yml, types.py).
# model_name=gemma4-26b + override_model_config: the gemma4 decoder block (5 sliding : 1
# global, Gemma4's partial RoPE), every shape overridden below.
MODEL_KEYS = {
    "model_name": "gemma4-26b", "override_model_config": "true",
    "base_num_decoder_layers": "48", "base_emb_dim": "4096",
    "base_num_query_heads": "64",
    "base_num_kv_heads": "8", "global_num_kv_heads": "4",   # sliding 8, full 4 KV heads
    "head_dim": "192", "global_head_dim": "192",           # one width for q, k and v
    "num_experts": "256", "num_experts_per_tok": "8", "base_moe_mlp_dim": "2048",
    # gemma4's MoE always has a shared expert (0 fails: a zero-width MLP); the narrowest one:
    "shared_experts": "1", "base_mlp_dim": "128",
    "routed_score_func": "sigmoid", "routed_bias": "true", "norm_topk_prob": "true",
    "load_balance_loss_weight": "0.0",
    "mlp_activations": "[silu,linear]",
    "vocab_size": "152576", "logits_via_embedding": "false", "final_logits_soft_cap": "0.0",
    "share_kv_projections": "false",
    "sliding_window_size": "128",
    "local_rope_proportion": "0.3333333333333333", "global_rope_proportion": "0.3333333333333333",
    "local_rope_max_timescale": "10000", "global_rope_max_timescale": "5000000",
    # Sinks off: with fp32 weights and bf16 compute MaxText 0.2.5 fails to trace them
    # (AssertionError: (ShapedArray(float32[64]), ShapedArray(bfloat16[64])) in splash's VJP).
    "attention_sink": "false",
    "attention": "flash",
    "weight_dtype": "float32", "dtype": "bfloat16", "grad_dtype": "float32",
    "remat_policy": "full",
    # 256 rows x 32768 tokens per step: 0.25 rows per chip per micro-batch, 2 micro-batches.
    "max_target_length": "32768", "per_device_batch_size": "0.25",
    "gradient_accumulation_steps": "2",
    "ici_fsdp_parallelism": "16", "ici_expert_parallelism": "8", "ici_tensor_parallelism": "4",
    "compile_topology": TOPOLOGY, "compile_topology_num_slices": "1",
    "allow_split_physical_axes": "true",   # fsdp 16 on an 8x8x8 torus splits a dimension
    "dataset_type": "synthetic", "enable_checkpointing": "false",
}
VARIANTS = {
    "default": {},
    "ring": {"use_ring_of_experts": "true"},
    "ring_chunks8": {"use_ring_of_experts": "true", "num_moe_token_chunks": "8"},
    # gagar_jax's configs run the expert exchange over 16 token chunks (`model.ep_chunks`)
    "ring_chunks16": {"use_ring_of_experts": "true", "num_moe_token_chunks": "16"},
}
LABELS = {"gagar": "gagar_jax", "default": "MaxText default",
          "ring": "MaxText ring of experts", "ring_chunks8": "MaxText ring + 8 token chunks",
          "ring_chunks16": "MaxText ring + 16 token chunks"}

_ALLOC = re.compile(r"^allocation \d+: size (\d+)(.*):$", re.M)
_STATS = re.compile(r"Memory analysis: CompiledMemoryStats\(([^)]*)\)")


def buffer_assignment_totals(text: str) -> dict:
    """Bytes per memory space from a `*buffer-assignment.txt`: {"hbm" (color 0, thread-local left
    out), "parameters" (of it, the entry parameters: memory_analysis' arguments), "thread_local"
    (color 0), "other_colors": {color: bytes} (TPU: 1 = VMEM, 2 = SMEM, ...), "allocations"}."""
    hbm = params = thread_local = n = 0
    other: dict[str, int] = {}
    for m in _ALLOC.finditer(text):
        size, rest = int(m.group(1)), m.group(2)
        n += 1
        color = re.search(r", color (\d+)", rest)
        if color:
            other[color.group(1)] = other.get(color.group(1), 0) + size
        elif "thread-local" in rest:
            thread_local += size
        else:
            hbm += size
            params += size if ", parameter " in rest else 0
    return {"hbm": hbm, "parameters": params, "thread_local": thread_local,
            "other_colors": other, "allocations": n}


def dump_buffer_assignment(dump_dir: str) -> dict:
    """`buffer_assignment_totals` of the dump's largest module, with its file name; {} if none."""
    files = [f for f in glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt"))]
    if not files:
        return {}
    path = max(files, key=os.path.getsize)
    with open(path) as f:
        return {"file": os.path.basename(path), **buffer_assignment_totals(f.read())}


def parse_memory_analysis(log: str) -> dict | None:
    """The last `Memory analysis: CompiledMemoryStats(...)` line train_compile printed, as
    {arguments, outputs, aliases, temporaries, code, total}; None if there is none."""
    found = _STATS.findall(log)
    if not found:
        return None
    f = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", found[-1])}
    out = {"arguments": f["argument_size_in_bytes"], "outputs": f["output_size_in_bytes"],
           "aliases": f["alias_size_in_bytes"], "temporaries": f["temp_size_in_bytes"],
           "code": f["generated_code_size_in_bytes"]}
    out["total"] = (out["arguments"] + out["outputs"] - out["aliases"] + out["temporaries"]
                    + out["code"])
    return out


def measure(dump_dir: str, memory: dict | None) -> dict:
    """(b) and (c) from a dump, beside (a) `memory` (memory_analysis' figures or None)."""
    from gagar_jax.aot import buffers
    peak = buffers.peak_buffers(dump_dir, top=12, min_bytes=256 * 2**20) if dump_dir else {}
    return {"memory_analysis": memory,
            "buffer_assignment": dump_buffer_assignment(dump_dir) if dump_dir else {},
            "peak_live_bytes": peak.get("peak_bytes"), "peak_buffers": peak.get("buffers", [])}


def gagar_column(report_path: str, dump_dir: str) -> dict:
    """The gagar_jax column from an `aot_compile.py` report (its memory_analysis) and dump."""
    with open(report_path) as f:
        r = json.load(f)
    mem = dict(r["memory"]) if r.get("memory") else None
    if mem:
        mem["total"] = (mem["arguments"] + mem["outputs"] - mem["aliases"] + mem["temporaries"]
                        + mem["code"])
    col = measure(dump_dir, mem) if dump_dir else {
        "memory_analysis": mem, "buffer_assignment": {},
        "peak_live_bytes": r.get("peak_live_bytes_xla"), "peak_buffers": []}
    col.update(name="gagar", status="compiled" if mem else (r.get("error") or "no figures"),
               compile_seconds=r.get("compile_seconds"), report=os.path.relpath(report_path, REPO),
               commit=r.get("commit"), overrides=r.get("overrides"), hbm_oom=None,
               libtpu=libtpu_version())
    if not mem and r.get("per_device_bytes"):
        col["hbm_oom"] = {"required_bytes": r["per_device_bytes"],
                          "available_bytes": r.get("hbm_bytes")}
    return col


def libtpu_version(python: str = sys.executable) -> str:
    """The libtpu version `python`'s environment holds (the TPU compiler its compiles use):
    .venv-maxtext's for MaxText's columns, this interpreter's for gagar_jax's."""
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; "
                            "print(m.version('libtpu'))"], capture_output=True, text=True)
    return probe.stdout.strip() or "unknown"


def maxtext_argv(variant: str) -> list[str]:
    """train_compile's command line for one variant (the base.yml from the installed package)."""
    base = subprocess.run([MAXTEXT_PY, "-c", "import maxtext, os; print(os.path.join("
                           "os.path.dirname(maxtext.__file__), 'configs', 'base.yml'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    keys = {**MODEL_KEYS, **VARIANTS[variant], "run_name": f"side_by_side_{variant}",
            "base_output_directory": "/tmp/maxtext_side_by_side_out"}
    return [MAXTEXT_PY, "-m", "maxtext.trainers.pre_train.train_compile", base,
            *(f"{k}={v}" for k, v in keys.items())]


def capped(cmd: list[str], cap_gb: float) -> tuple[list[str], str]:
    """`cmd` run inside the cgroup-v1 memory cap (created here), or as is with a note why not."""
    if cap_gb <= 0:
        return cmd, "no memory cap (--mem_cap_gb 0)"
    try:
        os.makedirs(CGROUP, exist_ok=True)
        with open(os.path.join(CGROUP, "memory.limit_in_bytes"), "w") as f:
            f.write(str(int(cap_gb * GiB)))
        with open(os.path.join(CGROUP, "memory.max_usage_in_bytes"), "w") as f:
            f.write("0")                                    # reset the high-water mark
    except OSError as e:
        return cmd, f"no memory cap: {CGROUP} not writable ({e.strerror})"
    tasks = os.path.join(CGROUP, "tasks")
    return ["sh", "-c", f'echo $$ > {tasks} && exec "$@"', "sh", *cmd], f"capped at {cap_gb} GiB"


def _cgroup_read(name: str) -> str:
    try:
        with open(os.path.join(CGROUP, name)) as f:
            return f.read()
    except OSError:
        return ""


def _oom_kills() -> int:
    m = re.search(r"oom_kill (\d+)", _cgroup_read("memory.oom_control"))
    return int(m.group(1)) if m else 0


def _free_gib() -> str:
    try:
        return subprocess.run(["free", "-g"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def past_buffer_assignment(dump_dir: str, module: str = "jit_train_step") -> bool:
    """Whether the dump holds `module`'s optimized HLO, buffer assignment and live ranges: all
    three are written together after buffer assignment, before code generation, so measures (b)
    and (c) are final from then on."""
    pattern = f"*{module}*after_optimizations-buffer-assignment.txt"
    stems = glob.glob(os.path.join(dump_dir, pattern))
    return any(os.path.exists(s.replace("-buffer-assignment.txt", "-live-range.txt"))
               for s in stems)


def run_capped(cmd: list[str], log_path: str, env: dict, cap_gb: float, timeout_s: int,
               stop_when=None, stop_grace_s: float = 10) -> dict:
    """Runs `cmd` (capped), its output to `log_path`: rc, wall seconds, host memory, kills.
    `stop_when()`, polled every 2 s, ends the run early (rc "stopped") `stop_grace_s` after it
    is first true (the dump's files are written one after the other)."""
    print(_free_gib(), flush=True)
    cmd, note = capped(cmd, cap_gb)
    print(f"  {note}", flush=True)
    kills = _oom_kills()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while True:     # os.wait4: this child's own peak RSS (not the whole cgroup's)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                break
            stop = stop_when is not None and stop_when()
            if stop or time.monotonic() - t0 > timeout_s:
                if stop:
                    time.sleep(stop_grace_s)
                proc.kill()
                _, _, usage = os.wait4(proc.pid, 0)
                rc = "stopped" if stop else "timeout"
                break
            time.sleep(2)
    peak = _cgroup_read("memory.max_usage_in_bytes").strip()
    killed = "capped" in note and _oom_kills() > kills
    try:
        os.rmdir(CGROUP)        # empty now that the compile has ended
    except OSError:
        pass
    return {"rc": rc, "wall_seconds": round(time.monotonic() - t0, 1), "mem_cap": note,
            "cgroup_max_usage_bytes": int(peak) if peak and "capped" in note else None,
            "max_rss_bytes": usage.ru_maxrss * 1024,
            "killed_by_cap": killed}


def _env(dump_dir: str, module_re: str = "") -> dict:
    from gagar_jax.aot import compile as aot
    aot.configure_libtpu_env()
    flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
    if module_re:
        flags += f" --xla_dump_hlo_module_re={module_re}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


def run_maxtext(variant: str, workdir: str, cap_gb: float, timeout_s: int,
                remeasure: bool = False, until_buffer_assignment: bool = False) -> dict:
    """Compiles one variant (unless `remeasure` and it ran before) and measures what it reached:
    all three figures when it finished, the dump's when it stopped after buffer assignment
    (`until_buffer_assignment`: on purpose, as soon as the dump has it, skipping code
    generation)."""
    from gagar_jax.aot import compile as aot
    out = os.path.join(workdir, variant)
    dump = os.path.join(out, "dump")
    run_json = os.path.join(out, "run.json")
    print(f"MaxText {variant}: {' '.join(f'{k}={v}' for k, v in VARIANTS[variant].items())}",
          flush=True)
    if remeasure and os.path.exists(run_json):
        with open(run_json) as f:
            run = json.load(f)
    else:
        os.makedirs(dump, exist_ok=True)
        for f in glob.glob(os.path.join(dump, "*")):
            if os.path.isfile(f):
                os.remove(f)
        stop = (lambda: past_buffer_assignment(dump)) if until_buffer_assignment else None
        run = run_capped(maxtext_argv(variant), os.path.join(out, "log.txt"),
                         _env(dump, "jit_train_step"), cap_gb, timeout_s, stop)
        run["libtpu"] = libtpu_version(MAXTEXT_PY)
        with open(run_json, "w") as f:
            json.dump(run, f, indent=2)
    with open(os.path.join(out, "log.txt"), errors="replace") as f:
        log = f.read()
    memory = parse_memory_analysis(log)
    oom = None if memory else aot.parse_hbm_oom(log)
    col = {"name": variant, "keys": VARIANTS[variant], **run, **measure(dump, memory),
           "hbm_oom": oom, "compile_seconds": run["wall_seconds"]}
    if memory:
        col["status"] = "compiled"
    elif oom:
        col["status"] = "compile-time HBM OOM"
    elif run["rc"] == "stopped":
        col["status"] = "stopped after buffer assignment (--until_buffer_assignment)"
    elif run["rc"] == "timeout":
        col["status"] = f"stopped at the {run['wall_seconds']:.0f} s limit (--timeout_s)"
    elif run["killed_by_cap"] or run["rc"] in (-9, 137):
        col["status"] = f"killed by the {cap_gb:g} GiB host-memory cap"
    else:
        errors = [ln for ln in log.splitlines() if re.match(r"[\w.]*(Error|Exception)\b", ln)]
        col["status"] = f"failed (rc {run['rc']}): {errors[-1] if errors else log[-300:]}"
    if not memory and col["buffer_assignment"]:
        col["status"] += " (buffer assignment read from the dump)"
    print(f"  {col['status']}, {run['wall_seconds']} s", flush=True)
    return col


def compile_gagar(workdir: str, cap_gb: float, timeout_s: int, out_json: str) -> tuple[str, str]:
    """Runs scripts/aot_compile.py for flash_310b with splash; returns (report, dump dir)."""
    dump = os.path.join(workdir, "gagar", "dump")
    os.makedirs(dump, exist_ok=True)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "aot_compile.py"),
           "--config", os.path.join(REPO, "configs", "flash_310b.py"), "--topology", "v5p:8x8x8",
           "--config.model.attention=splash", "--dump_dir", dump, "--out", out_json]
    run = run_capped(cmd, os.path.join(workdir, "gagar", "log.txt"), _env(dump), cap_gb,
                     timeout_s)
    if run["rc"] != 0:
        raise SystemExit(f"maxtext_side_by_side: gagar compile failed: {run}")
    return out_json, dump


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / GiB:.2f}"


def side_by_side_table(columns: list[dict]) -> str:
    """The markdown table: one column per compile, one row per figure (GiB per chip)."""
    def ma(c, key):
        return _gib(c["memory_analysis"][key]) if c.get("memory_analysis") else "-"

    def args(c):
        if c.get("memory_analysis"):
            return ma(c, "arguments")
        b = c.get("buffer_assignment") or {}
        return f"{_gib(b['parameters'])} (b)" if "parameters" in b else "-"

    def total(c):
        if c.get("memory_analysis"):
            return _gib(c["memory_analysis"]["total"])
        oom = c.get("hbm_oom") or {}
        return f"HBM OOM at {_gib(oom['required_bytes'])}" if oom.get("required_bytes") else "-"

    def ba(c):
        b = c.get("buffer_assignment") or {}
        return _gib(b["hbm"]) if "hbm" in b else "-"

    def secs(c):
        s = c.get("compile_seconds")
        return "-" if s is None else f"{s:.0f}"

    def host(c):
        b = c.get("max_rss_bytes")
        return "-" if not b else _gib(b)

    rows = [("arguments GiB (memory_analysis)", args),
            ("temporaries GiB (memory_analysis)", lambda c: ma(c, "temporaries")),
            ("code GiB (memory_analysis)", lambda c: ma(c, "code")),
            ("(a) total GiB, memory_analysis", total),
            ("(b) total GiB, buffer assignment (HBM)", ba),
            ("(c) XLA peak live set GiB", lambda c: _gib(c.get("peak_live_bytes"))),
            ("compile s", secs), ("host peak RSS GiB", host),
            ("libtpu", lambda c: c.get("libtpu") or "-"),
            ("status", lambda c: c.get("status", "-"))]
    head = "| | " + " | ".join(LABELS.get(c["name"], c["name"]) for c in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    lines += ["| " + name + " | " + " | ".join(f(c) for c in columns) + " |" for name, f in rows]
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=REPO, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated MaxText variants of {list(VARIANTS)}")
    p.add_argument("--workdir", default=os.path.join(REPO, "build", "maxtext_side_by_side"))
    p.add_argument("--mem_cap_gb", type=float, default=16.0,
                   help="cgroup-v1 memory cap of each compile (0: none)")
    p.add_argument("--timeout_s", type=int, default=3600, help="per compile")
    p.add_argument("--until_buffer_assignment", default="ring_chunks8,ring_chunks16",
                   help="comma-separated variants whose compile stops once the dump has the "
                        "buffer assignment (measures (b) and (c); no memory_analysis); the "
                        "chunked ones by default: their code generation wants over 16 GiB of "
                        "host memory; '' compiles every variant to the end")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the variants' earlier compiles in --workdir, compile no more")
    p.add_argument("--gagar_report", default="", help="an aot_compile.py report (JSON)")
    p.add_argument("--gagar_dump", default="", help="that compile's --dump_dir")
    p.add_argument("--compile_gagar", action="store_true",
                   help="compile flash_310b (splash) here first (~10 min) for the gagar column")
    p.add_argument("--out", default="", help="JSON (default docs/aot/maxtext_side_by_side.json)")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"maxtext_side_by_side: error: unknown variant {bad[0]!r} (known: {list(VARIANTS)})",
              file=sys.stderr)
        return 2
    if variants and not os.path.exists(MAXTEXT_PY):
        print(f"maxtext_side_by_side: error: {MAXTEXT_PY} missing; run `make maxtext`",
              file=sys.stderr)
        return 2
    if a.gagar_report and not os.path.exists(a.gagar_report):
        print(f"maxtext_side_by_side: error: --gagar_report {a.gagar_report} not found",
              file=sys.stderr)
        return 2
    commit = _commit()
    # one report per variant, the commit inside: a rerun replaces it (git keeps the old one)
    out = a.out or os.path.join(REPO, "docs", "aot", "maxtext_side_by_side.json")
    if a.compile_gagar:
        a.gagar_report, a.gagar_dump = compile_gagar(
            a.workdir, a.mem_cap_gb, a.timeout_s,
            os.path.join(REPO, "docs", "aot", "flash_310b_splash_v5p_8x8x8.json"))
    columns = [gagar_column(a.gagar_report, a.gagar_dump)] if a.gagar_report else []
    for v in variants:
        columns.append(run_maxtext(v, a.workdir, a.mem_cap_gb, a.timeout_s, a.remeasure,
                                   v in a.until_buffer_assignment.split(",")))
    table = side_by_side_table(columns)
    print(table)
    with open(out, "w") as f:
        json.dump({"commit": commit, "topology": TOPOLOGY, "maxtext_keys": MODEL_KEYS,
                   "variants": {v: VARIANTS[v] for v in variants}, "columns": columns,
                   "table": table}, f, indent=2)
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
