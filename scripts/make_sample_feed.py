"""Writes realistic synthetic graded groups as a feed shard (JSONL or ArrayRecord by suffix).

Usage:
  python scripts/make_sample_feed.py --out data/sample_feed.jsonl --groups 96 --seed 0 \
      --rescore-config configs/tiny_cpu.py

`--rescore-config`: the generated tokens' behaviour log-probs (and routed experts) become those
of that config's initial policy (`gagar_jax/run/rescore.py`), so a run of that config is
on-policy at step 1 (`make train`: approx_kl ~0 instead of 4.4).
"""
import argparse
import dataclasses

from gagar_jax.feed import convert, synthetic


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output *.jsonl or *.arrayrecord")
    p.add_argument("--groups", type=int, required=True, help="number of groups")
    p.add_argument("--seed", type=int, default=0)
    # The tiny config trains 6 mixed groups per step and reads about 8 records for them (some
    # are uniform): versions advancing every 8 groups never run ahead of the learner's step
    # (docs/feed.md, max_future_versions) and lag it by at most 4 (max_staleness) on this feed.
    p.add_argument("--groups-per-step", type=int, default=8,
                   help="records per policy_version (the producer's pace)")
    p.add_argument("--rescore-config", default="",
                   help="re-score the generated tokens under this config's initial policy")
    args = p.parse_args(argv)
    spec = dataclasses.replace(synthetic.SyntheticSpec(), groups_per_step=args.groups_per_step)
    groups = synthetic.make_groups(args.groups, seed=args.seed, spec=spec)
    if args.rescore_config:
        from gagar_jax.config import load_config_file
        from gagar_jax.run.rescore import rescore
        groups = rescore(groups, load_config_file(args.rescore_config))
    n = convert.write_groups(args.out, groups)
    print(f"wrote {n} groups to {args.out}")


if __name__ == "__main__":
    main()
