"""Writes realistic synthetic graded groups as a feed shard (JSONL or ArrayRecord by suffix).

Usage:
  python scripts/make_sample_feed.py --out data/sample_feed.jsonl --groups 96 --seed 0
"""
import argparse

from gagar_jax.feed import convert, synthetic


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output *.jsonl or *.arrayrecord")
    p.add_argument("--groups", type=int, required=True, help="number of groups")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n = convert.write_groups(args.out, synthetic.make_groups(args.groups, seed=args.seed))
    print(f"wrote {n} groups to {args.out}")


if __name__ == "__main__":
    main()
