"""Converts a feed shard between JSON Lines and ArrayRecord (msgpack records), by suffix.

Usage:
  python scripts/convert_feed.py data/sample_feed.jsonl /tmp/sample_feed.arrayrecord
  python scripts/convert_feed.py /tmp/sample_feed.arrayrecord /tmp/roundtrip.jsonl
  python scripts/convert_feed.py --compact-routing in.jsonl out.jsonl   # compact routed_experts
"""
import argparse

from gagar_jax.feed import convert


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", help="input *.jsonl or *.arrayrecord")
    p.add_argument("dst", help="output *.jsonl or *.arrayrecord (written atomically)")
    p.add_argument("--compact-routing", action="store_true",
                   help="rewrite nested-list routed_experts as compact uint8/uint16 base64 arrays")
    args = p.parse_args(argv)
    stats = convert.convert(args.src, args.dst, compact_routing=args.compact_routing)
    print(f"converted {stats.records} records ({stats.skipped_unparseable} unparseable skipped) "
          f"-> {args.dst}")


if __name__ == "__main__":
    main()
