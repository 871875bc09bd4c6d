"""``python -m engine_api.conformance STRATEGY [--nproc N] [--set key=value ...] [--only CHECK ...]``.

Exit status 0 when no check failed, 1 otherwise; the summary lists every check.
"""

from __future__ import annotations

import argparse
import os
import sys

from engine_api.conformance.checks import CHECKS
from engine_api.conformance.runner import run_conformance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_api.conformance", description=__doc__.splitlines()[0])
    parser.add_argument("strategy", help="registered name, entry-point name, or package.module:ClassName")
    parser.add_argument("--nproc", type=int, default=1, help="processes per launch (default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="engine setting for every check")
    parser.add_argument("--only", nargs="+", choices=list(CHECKS), help="run only these checks")
    parser.add_argument("--workdir", help="keep the model and checkpoints here (default: a temporary directory)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for check in CHECKS.values():
            print(f"{check.name}: {check.doc}")
        return 0
    if args.nproc < 1:
        parser.error(f"--nproc = {args.nproc}: must be >= 1")
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "0") != "0":
        return 0  # under a launcher: rank 0 runs the kit (it starts its own processes); the others wait out
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        print(
            f"note: running under a launcher (WORLD_SIZE={os.environ['WORLD_SIZE']}); the kit starts its own --nproc processes", flush=True
        )
    try:
        report = run_conformance(args.strategy, args.nproc, args.overrides, args.only, args.workdir)
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
