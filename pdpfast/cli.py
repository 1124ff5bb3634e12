"""The ``pdpfast`` command line."""
from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import DELTA, GROUP_EPSILONS, GROUP_FRACTIONS, format_results, run_demo

    print(f"pdpfast demo: digits, privacy groups {', '.join(f'{f:.0%} at ε={e:g}' for f, e in zip(GROUP_FRACTIONS, GROUP_EPSILONS))}, "
          f"δ={DELTA:g}; {args.epochs} epochs, seeds {args.seeds}")
    results = run_demo(epochs=args.epochs, seeds=tuple(range(args.seeds)), progress=not args.quiet)
    print(format_results(results))
    return 0


def _info(args) -> int:
    from .info import report

    print(report())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdpfast", description="Individualized differential privacy for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="individualized DP-SGD vs DP-SGD vs non-private on scikit-learn's digits")
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--seeds", type=int, default=3, help="number of seeds to average over")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)
    info = sub.add_parser("info", help="which implementation each op uses, and why")
    info.set_defaults(run=_info)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"pdpfast {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
