"""Feed throughput: groups/s and tokens/s decoded, validated and packed, JSONL vs ArrayRecord.

Usage:
  JAX_PLATFORMS=cpu python scripts/bench_feed.py [--groups 1500] [--long-groups 120] \
      [--repeats 3] [--no-write]

Two shapes: the tiny config's (trajectories of 24-110 tokens, [16, 128] batches) and a
long-context one (1-4k-token trajectories, [16, 8192] batches). Writes the
"## Feed (scripts/bench_feed.py)" section of docs/performance.md.
"""
import argparse
import dataclasses
import pathlib
import re
import tempfile
import time

import grain.python  # noqa: F401  (imported up front: not part of the timed loop)

from gagar_jax.feed import Feed, FeedConfig, FileSource, convert, synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = dict(vocab_size=256, num_moe_layers=2, top_k=2, num_experts=8)
SHAPES = {
    "tiny": (synthetic.SyntheticSpec(),
             FeedConfig(rows_per_batch=16, seq_len=128, max_trajectories=40, groups_per_batch=6,
                        max_traj_tokens=128, max_staleness=10**9)),
    "long": (synthetic.SyntheticSpec(vocab_size=256, min_len=1000, max_len=4000, p_routed=0.0),
             FeedConfig(rows_per_batch=16, seq_len=8192, max_trajectories=64, groups_per_batch=8,
                        max_traj_tokens=8192, max_staleness=10**9)),
}


def run_feed(cfg: FeedConfig, path: pathlib.Path, workdir: pathlib.Path):
    """Drains the feed over `path`; returns (seconds, groups received, tokens packed, eff)."""
    feed = Feed(cfg, workdir, **MODEL, source=FileSource(str(path)), log=lambda _: None)
    t0 = time.perf_counter()
    tokens, effs, step = 0, [], 0
    while (item := feed.next_batch(step)) is not None:
        tokens += item[1].num_tokens
        effs.append(item[1].packing_efficiency)
        step += 1
    seconds = time.perf_counter() - t0
    return seconds, feed.finish().received, tokens, sum(effs[:-1]) / max(1, len(effs) - 1)


def bench(name: str, num_groups: int, tmp: pathlib.Path, repeats: int) -> list:
    spec, cfg = SHAPES[name]
    spec = dataclasses.replace(spec, groups_per_step=10**9)      # all fresh: no staleness
    groups = synthetic.make_groups(num_groups, seed=0, spec=spec)
    rows = []
    for suffix in ("jsonl", "arrayrecord"):
        path = tmp / f"{name}.{suffix}"
        convert.write_groups(path, groups)
        # Best of `repeats` (the host is shared; the minimum is the least disturbed run).
        seconds, received, tokens, eff = min(
            run_feed(cfg, path, tmp / f"run-{name}-{suffix}-{k}") for k in range(repeats))
        rows.append(dict(shape=name, encoding=suffix, groups=received, seconds=seconds,
                         groups_s=received / seconds, tokens_s=tokens / seconds,
                         mb=path.stat().st_size / 2**20, efficiency=eff,
                         batch=f"[{cfg.rows_per_batch}, {cfg.seq_len}]"))
        print(f"{name:5s} {suffix:12s} {received:6d} groups {seconds:7.2f} s  "
              f"{received / seconds:9.1f} groups/s  {tokens / seconds:12,.0f} packed tokens/s  "
              f"packing efficiency {eff:.3f}")
    return rows


def write_section(rows: list) -> None:
    lines = ["## Feed (scripts/bench_feed.py)", "",
             "Decode + validate + dynamic sampling + packing, single process, one CPU core, "
             "from a local shard, best of 3 runs (`JAX_PLATFORMS=cpu python scripts/bench_feed.py`). "
             "Tokens/s counts tokens packed into batches (uniform groups are dropped and not "
             "counted). Efficiency = packed tokens / (B x S), last partial batch excluded.", "",
             "| shape | batch [B, S] | encoding | shard MiB | groups | groups/s | packed tokens/s "
             "| packing efficiency |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['encoding']} | {r['mb']:.1f} | {r['groups']} | "
                     f"{r['groups_s']:,.0f} | {r['tokens_s']:,.0f} | {r['efficiency']:.3f} |")
    by = {(r["shape"], r["encoding"]): r for r in rows}
    for shape in sorted({r["shape"] for r in rows}):
        ratio = by[(shape, "arrayrecord")]["tokens_s"] / by[(shape, "jsonl")]["tokens_s"]
        lines.append("")
        lines.append(f"- {shape}: ArrayRecord/JSONL throughput ratio {ratio:.2f}x.")
    section = "\n".join(lines) + "\n"
    doc = ROOT / "docs" / "performance.md"
    text = doc.read_text() if doc.exists() else "# Performance\n"
    pattern = re.compile(r"## Feed \(scripts/bench_feed\.py\)\n.*?(?=\n## |\Z)", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section.rstrip("\n") + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)
    print(f"wrote the feed section of {doc}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=1500, help="groups for the tiny shape")
    p.add_argument("--long-groups", type=int, default=120, help="groups for the long shape")
    p.add_argument("--repeats", type=int, default=3, help="runs per case (best is reported)")
    p.add_argument("--no-write", action="store_true", help="do not edit docs/performance.md")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench("tiny", args.groups, pathlib.Path(tmp), args.repeats)
        rows += bench("long", args.long_groups, pathlib.Path(tmp), args.repeats)
    if not args.no_write:
        write_section(rows)


if __name__ == "__main__":
    main()
