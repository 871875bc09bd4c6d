"""Same numbers before and after a restructuring: run a fixed set of short runs in this tree and
in another revision's, and compare every metric they log, bit for bit, timings left out.

    python ci/same_behaviour.py --against REV [--only NAME ...] [--keep DIR] [--this-extra KEY=VALUE ...] [--extra KEY=VALUE ...]

REV's tree is checked out with ``git worktree`` into a temporary directory and its runs use it
(``PYTHONPATH`` and the working directory: this venv's Python, that revision's code). The runs:

* ``ppo``: ``configs/ppo_tiny.yaml`` (critic + GAE), 3 steps;
* ``grpo``: ``configs/grpo_tiny.yaml``, 3 steps;
* ``async``: GRPO at ``async.max_staleness=2`` with partial rollouts, 5 steps; and the same run
  stopped after a checkpoint at step 3 by REV's code and resumed to step 5 by this tree's (an
  asynchronous state written before the change must resume after it, as the uninterrupted run);
* ``agent``: the multi-turn demo (``configs/agent_tiny.yaml`` on the assets
  ``posttrain.agents.demo.build_assets`` writes), 3 steps, and at ``async.max_staleness=2``
  with trajectories paused between turns, 4 steps;
* ``tinker``: the Tinker server (``configs/tinker_tiny.yaml``) and two tinker-cookbook
  ``sl_loop``s against it at once (runs sharing one engine), each loop's metrics.

``--this-extra``: overrides only this tree's recipe runs get (a key the change added, set to the
old behaviour: e.g. ``env.schedule=lockstep``). ``--extra``: overrides both trees' recipe runs get:
the ``agent`` runs of a revision with per-trajectory scheduling (issue 62) need
``--extra env.schedule=lockstep`` to be deterministic, since under ``per_trajectory`` which calls
share a batched forward depends on timing, and a row's rollout log-probs move in the 7th digit
with its batch (docs/agents.md); the trained numbers do not depend on them. Exit status 0 when every run's metrics are equal, 1 otherwise (each difference printed).
Timings (keys ending in ``_s``, ``tokens_per_s``, the asynchronous wait / idle fractions) differ
from run to run and are left out. Needs the project's test environment (``make install``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
TIMING_SUFFIXES = ("_s", "tokens_per_s")
TIMING_KEYS = {"async/trainer_wait_frac", "async/rollout_idle_frac", "time", "seconds", "elapsed", "time_total"}
COMMON = ["trainer.progress_bar=false", "trainer.save_hf=false", "trainer.loggers=[jsonl]"]
THIS_EXTRA: list[str] = []  # --this-extra
BOTH_EXTRA: list[str] = []  # --extra


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TINKER_TELEMETRY"] = "0"
    return env


def _python(tree: Path, args: list[str], timeout: int = 1200) -> None:
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=_env(tree), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} in {tree} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return [{k: v for k, v in r.items() if not k.endswith(TIMING_SUFFIXES) and k not in TIMING_KEYS} for r in rows]


def _recipe(tree: Path, out: Path, config: str, steps: int, *extra: str) -> list[dict]:
    _python(
        tree,
        [
            "-m",
            "recipes.ppo",
            "--config",
            f"configs/{config}",
            f"trainer.output_dir={out}",
            f"trainer.total_steps={steps}",
            *COMMON,
            *extra,
            *BOTH_EXTRA,
            *(THIS_EXTRA if tree == HERE else []),
        ],
    )
    return _metrics(out / "metrics.jsonl")


def run_ppo(tree: Path, work: Path, ref: Path | None) -> dict[str, list[dict]]:
    return {"ppo": _recipe(tree, work / "ppo", "ppo_tiny.yaml", 3)}


def run_grpo(tree: Path, work: Path, ref: Path | None) -> dict[str, list[dict]]:
    return {"grpo": _recipe(tree, work / "grpo", "grpo_tiny.yaml", 3)}


def run_async(tree: Path, work: Path, ref: Path | None) -> dict[str, list[dict]]:
    args = ("async.max_staleness=2", "async.partial_rollouts=true", "data.batch_size=4", "algo.n_samples=4")
    out = {"async": _recipe(tree, work / "async", "grpo_tiny.yaml", 5, *args)}
    if ref is not None:  # REV checkpoints every step; rolled back to step 3 (batches in flight), this tree resumes it
        cut = work / "async_resumed"
        _recipe(ref, cut, "grpo_tiny.yaml", 5, *args, "trainer.checkpoint_every=1")
        _roll_back(cut / "checkpoints", 3)
        out["async_resumed_from_ref"] = _recipe(tree, cut, "grpo_tiny.yaml", 5, *args, "trainer.checkpoint_every=1", "trainer.resume=true")
    return out


def _roll_back(ckpt: Path, step: int) -> None:
    """Make ``step`` the newest checkpoint of every role (later ones and their asynchronous
    states deleted, ``latest`` pointed back), as a run stopped after ``step`` leaves it."""
    import shutil

    for role in (d for d in ckpt.iterdir() if d.is_dir()):
        for entry in role.iterdir():
            stem = entry.name.split(".", 1)[0]
            if stem.startswith("global_step_") and int(stem[len("global_step_") :]) > step:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        pointer = role / "latest_checkpointed_iteration.txt"
        if pointer.exists():
            pointer.write_text(str(step))


def run_agent(tree: Path, work: Path, ref: Path | None) -> dict[str, list[dict]]:
    assets = work / "agent_assets"
    _python(tree, ["-c", f"from posttrain.agents.demo import build_assets; build_assets({str(assets)!r}, rows=64)"])
    data = [f"engine.model.path={assets}/model", f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]"]
    data += ["data.batch_size=4", "algo.n_samples=4", "trainer.checkpoint_every=0"]
    return {
        "agent": _recipe(tree, work / "agent", "agent_tiny.yaml", 3, *data),
        "agent_async": _recipe(tree, work / "agent_async", "agent_tiny.yaml", 4, *data, "async.max_staleness=2"),
    }


def run_tinker(tree: Path, work: Path, ref: Path | None) -> dict[str, list[dict]]:
    port = 18700 + (os.getpid() % 500)
    model = work / "tinker_model"
    _python(tree, ["-c", f"from tinker_server.demo import build_demo_model; build_demo_model({str(model)!r})"])
    model_dir = model / "model"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinker_server",
            "--config",
            "configs/tinker_tiny.yaml",
            f"server.aliases=[meta-llama/Llama-3.2-1B={model_dir}]",
            f"server.port={port}",
            f"server.state_dir={work}/tinker_state",
        ],
        cwd=tree,
        env=_env(tree),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(port)
        loops = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "from tinker_server.demo import run_sl_loop; "
                    f"run_sl_loop('http://127.0.0.1:{port}', {str(model_dir)!r}, {str(work / f'sl{i}')!r}, save_every=0)",
                ],
                cwd=tree,
                env=_env(tree),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in (0, 1)
        ]
        for p in loops:
            _, err = p.communicate(timeout=1200)
            if p.returncode != 0:
                raise RuntimeError(f"an sl_loop in {tree} failed:\n{err[-4000:]}")
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {f"tinker_sl{i}": _metrics(work / f"sl{i}" / "metrics.jsonl") for i in (0, 1)}


def _wait_for(port: int, timeout: float = 180.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the Tinker server did not listen on {port} within {timeout:g} s")


RUNS = {"ppo": run_ppo, "grpo": run_grpo, "async": run_async, "agent": run_agent, "tinker": run_tinker}


def compare(a: dict[str, list[dict]], b: dict[str, list[dict]]) -> list[str]:
    """Every difference between two sets of runs' metrics, named."""
    out = []
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name), b.get(name)
        if ra is None or rb is None:
            out.append(f"{name}: only in {'this tree' if rb is None else 'the reference'}")
            continue
        if len(ra) != len(rb):
            out.append(f"{name}: {len(ra)} vs {len(rb)} logged steps")
        for i, (x, y) in enumerate(zip(ra, rb, strict=False)):
            for key in sorted(set(x) | set(y)):
                if x.get(key, "<absent>") != y.get(key, "<absent>"):
                    out.append(f"{name} row {i} {key}: {x.get(key, '<absent>')!r} (this tree) != {y.get(key, '<absent>')!r} (reference)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/same_behaviour.py", description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the reference revision (e.g. a commit before the change)")
    parser.add_argument("--only", nargs="*", choices=sorted(RUNS), help="run only these (default: all)")
    parser.add_argument("--keep", help="keep the runs' outputs in this directory")
    parser.add_argument("--this-extra", nargs="*", default=[], help="overrides for this tree's recipe runs only")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both trees' recipe runs")
    args = parser.parse_args(argv)
    THIS_EXTRA[:] = args.this_extra
    BOTH_EXTRA[:] = args.extra
    names = args.only or list(RUNS)
    root = Path(args.keep or tempfile.mkdtemp(prefix="same_behaviour_"))
    root.mkdir(parents=True, exist_ok=True)
    ref_tree = root / "reference_tree"
    if ref_tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=HERE, check=False)
    subprocess.run(["git", "worktree", "add", "--detach", str(ref_tree), args.against], cwd=HERE, check=True, capture_output=True)
    try:
        problems = []
        for name in names:
            began = time.monotonic()
            ref = RUNS[name](ref_tree, root / "ref" / name, None)
            mine = RUNS[name](HERE, root / "this" / name, ref_tree)
            found = compare({k: v for k, v in mine.items() if k in ref}, ref)
            found += [
                f"{k}: resumed run != this tree's uninterrupted run"
                for k in mine
                if k.endswith("_from_ref") and compare({k: mine[k]}, {k: mine[k.split("_resumed")[0]]})
            ]
            problems += found
            steps = sum(len(v) for v in mine.values())
            print(
                f"{name}: {'same' if not found else f'{len(found)} difference(s)'} ({steps} logged steps, {time.monotonic() - began:.0f} s)",
                flush=True,
            )
        for p in problems:
            print("  " + p)
        return 1 if problems else 0
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=HERE, check=False, capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
