"""``python -m engine_api.conformance STRATEGY [--nproc N] [--set key=value ...] [--only CHECK ...]``,
or ``python -m engine_api.conformance --rollout BACKEND [--set option=value ...] [--only CHECK ...]``.

The first form checks a training engine (``BaseEngine``) on ``--nproc`` fresh processes; the
second a rollout engine (``BaseRollout``) in this process, ``--set`` giving its backend options
(``RolloutEngineConfig.options``). Exit status 0 when no check failed, 1 otherwise; the summary
lists every check.
"""

from __future__ import annotations

import argparse
import os
import sys

from engine_api.conformance.checks import CHECKS
from engine_api.conformance.rollout_kit import ROLLOUT_CHECKS
from engine_api.conformance.rollout_runner import run_rollout_conformance
from engine_api.conformance.runner import run_conformance


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_api.conformance",
        description="Check a training engine (STRATEGY) or a rollout backend (--rollout BACKEND) against its contract.",
    )
    parser.add_argument("strategy", nargs="?", help="training engine: registered name, entry-point name, or package.module:ClassName")
    parser.add_argument(
        "--rollout",
        metavar="BACKEND",
        help="check a rollout backend instead: registered name (hf, vllm), entry-point name, or package.module:ClassName",
    )
    parser.add_argument("--nproc", type=int, default=1, help="processes per launch (default 1; training engines only)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine setting for every check (with --rollout: a backend option, the value read as YAML)",
    )
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run only these checks (see --list)")
    parser.add_argument("--workdir", help="keep the model and checkpoints here (default: a temporary directory)")
    parser.add_argument("--list", action="store_true", help="list the checks (with --rollout: the rollout checks) and exit")
    args = parser.parse_args(argv)
    checks = ROLLOUT_CHECKS if args.rollout is not None else CHECKS
    if args.list:
        for check in checks.values():
            print(f"{check.name}: {check.doc}")
        return 0
    if args.rollout is not None and args.strategy is not None:
        parser.error(f"give a training STRATEGY ({args.strategy!r}) or --rollout BACKEND ({args.rollout!r}), not both")
    if args.rollout is None and args.strategy is None:
        parser.error("the following arguments are required: strategy (or --rollout BACKEND)")
    unknown = [name for name in args.only or () if name not in checks]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(checks)}")
    if args.nproc < 1:
        parser.error(f"--nproc = {args.nproc}: must be >= 1")
    if args.rollout is not None and args.nproc != 1:
        parser.error(f"--nproc = {args.nproc}: a rollout engine is per-rank, the rollout kit runs one process; drop --nproc")
    options = _options(parser, args.overrides) if args.rollout is not None else None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and os.environ.get("RANK", "0") != "0":
        return 0  # under a launcher: rank 0 runs the kit (it starts its own processes); the others wait out
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        print(
            f"note: running under a launcher (WORLD_SIZE={os.environ['WORLD_SIZE']}); the kit starts its own --nproc processes", flush=True
        )
    try:
        if args.rollout is not None:
            report = run_rollout_conformance(args.rollout, args.workdir, args.only, options)
        else:
            report = run_conformance(args.strategy, args.nproc, args.overrides, args.only, args.workdir)
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    print(report.summary())
    return 0 if report.ok else 1


def _options(parser: argparse.ArgumentParser, pairs: list[str]) -> dict:
    """``--set key=value`` pairs as rollout backend options (values parsed as YAML: 0.3, true, null)."""
    import yaml

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            parser.error(f"--set {pair!r}: expected KEY=VALUE")
        options[key] = yaml.safe_load(value)
    return options


if __name__ == "__main__":
    sys.exit(main())
