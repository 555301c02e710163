"""Command line: ``mtpstate bench`` (also ``python -m mtpstate bench``)."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="mtpstate", description="mtpstate tools")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="RequestTable / RequestIndex against the loop / dict, in one run")
    b.add_argument("--quick", action="store_true", help="fewer sizes and repeats (well under a minute)")
    b.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], help="comma-separated N values")
    b.add_argument("--only", choices=["table", "index"], help="run one part")
    b.add_argument("--json", metavar="FILE", help="write results as JSON")
    b.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    args = p.parse_args(argv)
    if args.cmd == "bench":
        from mtpstate.bench import run

        what = (args.only,) if args.only else ("table", "index")
        run(quick=args.quick, sizes=args.sizes, json_path=args.json, plot_path=args.plot, what=what)
    return 0


if __name__ == "__main__":
    sys.exit(main())
