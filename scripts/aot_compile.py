"""Ahead-of-time compile of the real train step for a TPU topology, on this (CPU) machine.

    JAX_PLATFORMS=cpu python scripts/aot_compile.py --config configs/flash_310b.py \
        --topology v5p:8x8x8 [--out docs/aot/flash_310b.json] [--config.KEY=VALUE ...]
    ... --what=weights_io     per-host load/publish bytes and the compiled publish reshard
    ... --what=decode --slots=32 --context=200000 --sampler_mesh=expert=16,tensor=4
                              the JAX sampler's decode step (gagar_jax/aot/decode.py)

Prints a table (per-device memory, FLOPs, collective counts, compile time), writes the JSON
report, and prints as its LAST line a JSON object with `per_device_bytes`, `hbm_bytes` and
`fits`. A layout the TPU compiler finds out of HBM is reported as `fits: false` (exit code 0).
Library: `gagar_jax/aot/compile.py`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # libtpu must not look for a real TPU here


def _commit() -> str:
    """The tree being compiled, as `git describe --always --dirty` ("" outside a checkout)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, cwd=os.path.dirname(os.path.abspath(__file__)),
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv) -> int:
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "Config file.", flag_values=fv,
                                    lock_config=True)
    flags.DEFINE_string("topology", "v5p:2x2x1", "TPU topology, e.g. v5p:8x8x8.", flag_values=fv)
    flags.DEFINE_string("out", None, "JSON report path (default: aot_<config>_<topology>.json).",
                        flag_values=fv)
    flags.DEFINE_string("dump_dir", "", "Keep the compiler's HLO dump here.", flag_values=fv)
    flags.DEFINE_integer("num_slices", 1, "train_step: slices of --topology joined over DCN "
                         "(the mesh's dcn_* sizes say which axes cross them).", flag_values=fv)
    flags.DEFINE_enum("what", "train_step", ["train_step", "weights_io", "decode"],
                      "train_step, or weights_io: per-host load/publish bytes and the compiled "
                      "publish reshard (gagar_jax/aot/weights_io.py), or decode: the JAX "
                      "sampler's decode step (gagar_jax/aot/decode.py).", flag_values=fv)
    flags.DEFINE_integer("slots", 32, "decode: concurrent sequences.", flag_values=fv)
    flags.DEFINE_integer("context", 200_000, "decode: tokens each sequence holds.",
                         flag_values=fv)
    flags.DEFINE_integer("page", 256, "decode: positions per KV page.", flag_values=fv)
    flags.DEFINE_string("sampler_mesh", "expert=16,tensor=4",
                        "decode: the sampler's mesh sizes, axis=size,... (others 1).",
                        flag_values=fv)
    try:
        fv(argv)
    except (flags.Error, AttributeError, OSError) as e:
        print(f"aot_compile: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if fv.config is None:
        print("aot_compile: error: --config is required", file=sys.stderr)
        return 2

    from gagar_jax.aot import compile as aot

    name = os.path.splitext(os.path.basename(fv["config"].config_filename))[0]
    if fv.what == "weights_io":
        from gagar_jax.aot import weights_io as aot_weights_io
        report = {"config": name, **aot_weights_io.weights_io_report(fv.config, fv.topology)}
        out = fv.out or f"aot_weights_io_{name}_{fv.topology.replace(':', '_')}.json"
        with open(out, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report))
        return 0
    overrides = tuple(a for a in argv[1:] if a.startswith("--config."))
    commit = _commit()   # before the (minutes-long) compile: the tree it reads
    if fv.what == "decode":
        from gagar_jax.aot import decode as aot_decode
        try:
            mesh = {k: int(v) for k, v in (kv.split("=") for kv in fv.sampler_mesh.split(","))}
        except ValueError:
            print(f"aot_compile: error: --sampler_mesh {fv.sampler_mesh!r}: expected "
                  "axis=size,...", file=sys.stderr)
            return 2
        report = {"commit": commit, "overrides": list(overrides),
                  **aot_decode.decode_report(fv.config, fv.topology, mesh=mesh, slots=fv.slots,
                                             context=fv.context, page=fv.page, name=name,
                                             dump_dir=fv.dump_dir)}
        out = fv.out or f"aot_decode_{name}_{fv.topology.replace(':', '_')}.json"
        with open(out, "w") as f:
            json.dump(report, f, indent=2, sort_keys=True)
            f.write("\n")
        print(json.dumps({k: report[k] for k in ("config", "topology", "slots", "context",
                                                 "per_device_bytes", "hbm_bytes", "fits")}))
        return 0
    report = aot.compile_report(fv.config, fv.topology, name=name, dump_dir=fv.dump_dir,
                                overrides=overrides, num_slices=fv.num_slices)
    report = dataclasses.replace(report, commit=commit)
    out = fv.out or f"aot_{name}_{fv.topology.replace(':', '_')}.json"
    aot.write_report(report, out)
    print(report.table())
    print(f"report: {out}")
    print(json.dumps(report.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
