"""Multi-turn rollouts: per-trajectory scheduling against lock-step turns, and the gateway's cost
per call (issue 62, item 3 and the gateway overhead).

Scheduling: 32 trajectories of the multi-turn demo's tiny model (``posttrain.agents.demo``, the
``hf`` rollout, 5 new tokens a call), trajectory ``i`` taking ``1 + i % 8`` turns, each turn
answered by an environment whose tool takes a latency drawn uniformly from 0-200 ms (seeded per
trajectory and turn). The same trajectories (same seeds, so the same tokens: checked) are rolled
out two ways with ``posttrain.agents.AgentLoop``: ``env.schedule=lockstep`` (a turn's calls are
served once every trajectory has asked, so each turn ends with the slowest tool) and
``per_trajectory`` (each trajectory asks for its next turn as soon as its environment answered;
the rollout serves whatever waits). Wall time of the rollout, median of alternating
rounds; target: per-trajectory >= 1.7x faster.

Gateway: the time an HTTP call through the gateway takes (a keep-alive HTTP client in this
process, on localhost) minus the time of the rollout call that served it (the same prompt,
so the difference is the gateway's: HTTP, JSON, the chat template, the tokenizer, the hand-off
to the scheduler); median over calls; target: <= 3 ms.

Run: ``.venv/bin/python -m benchmarks.agent_scheduling [--quick]``.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import tempfile
import threading
import time

import torch

from benchmarks.common import Report, Row, cli, command_line, emit, set_threads

TRAJECTORIES, MAX_TURNS, MAX_LATENCY_S = 32, 8, 0.2
TARGET_SPEEDUP, TARGET_OVERHEAD_MS = 1.7, 3.0


class SlowTools:
    """The benchmark's environment: ``turns`` turns (the row's), each answered after the tool's
    latency (uniform 0-200 ms, seeded by the row and the turn)."""

    def __init__(self, prompt: str, turns: int, key: int, **columns) -> None:
        self.turns, self.key = int(turns), int(key)

    def step(self, turn):
        from posttrain.agents import StepResult

        time.sleep(random.Random(self.key * 1000 + turn.index).uniform(0, MAX_LATENCY_S))
        if turn.index + 1 >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult({"role": "user", "content": "1"}, 0.0, False)


def _rollout(model_dir: str):
    from engine_api.rollout import RolloutEngineConfig
    from engine_api.rollout_registry import build_rollout
    from roles.rollout import Rollout, RolloutConfig

    engine = build_rollout("hf", RolloutEngineConfig(model_path=model_dir, tokenizer_path=model_dir, seed=0, dtype="float32"))
    tok = engine.tokenizer
    return Rollout(None, engine, RolloutConfig(max_new_tokens=5, temperature=1.0), stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])


def _metas():
    from posttrain.text_data import PromptSample

    return [
        PromptSample(
            torch.zeros(1, dtype=torch.long),
            f"key {i:02d}",
            {"turns": 1 + i % MAX_TURNS, "key": i},
            f"bench:{i}",
            ({"role": "user", "content": f"key {i:02d}"},),
        )
        for i in range(TRAJECTORIES)
    ]


def _loop(tok, schedule: str):
    from posttrain.agents import AgentLoop, EnvConfig

    env = EnvConfig(function=f"{__name__}:SlowTools", max_turns=MAX_TURNS, max_tokens=512, step_timeout_s=30.0, schedule=schedule)
    return AgentLoop(env, tok, {}, [tok.convert_tokens_to_ids("<|im_end|>")], 1.0, None)


def _schedule(rollout, lockstep: bool) -> tuple[float, object]:
    loop = _loop(rollout.engine.tokenizer, "lockstep" if lockstep else "per_trajectory")
    run = loop.start(_metas(), list(range(TRAJECTORIES)))
    began = time.perf_counter()
    loop.advance(rollout, run, 5)
    seconds = time.perf_counter() - began
    out = loop.finish(run)
    loop.close()
    return seconds, out


def _gateway_overhead(rollout, calls: int) -> list[float]:
    """Per call: the client's wall time minus the rollout call's (ms)."""
    from posttrain.agents.scheduler import CallScheduler
    from posttrain.gateway.agents import Outcome
    from posttrain.gateway.server import Gateway, SessionRun
    from posttrain.gateway.session import Session, SessionLimits

    tok = rollout.engine.tokenizer
    limits = SessionLimits(256, 5, 4, "error", None, False, 1.0, 1.0, -1, "policy")
    gateway = Gateway("127.0.0.1", 0, 2**20, "policy", 4)
    gateway.start()
    served: list[float] = []
    sample = rollout.sample

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = sample(*args, **kwargs)
        served.append(time.perf_counter() - t0)
        return out

    rollout.sample = timed
    lock, runs = threading.Lock(), []
    for k in range(calls):
        session = Session(f"s{k}", None, k, tok, {}, [tok.convert_tokens_to_ids("<|im_end|>")], limits, lock)
        runs.append(SessionRun(session, gateway.url(session.id)))
        gateway.sessions[session.id] = runs[-1]
    scheduler = CallScheduler(rollout, window_s=0.0)
    for run in runs:
        run.grant(None, scheduler)
    client_ms: list[float] = []

    def client() -> None:
        # A plain keep-alive HTTP client: what is timed is the gateway, not an SDK's request
        # building and response parsing (the openai SDK adds about a millisecond of its own).
        conn = http.client.HTTPConnection(gateway.host, gateway.port)
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "key 01"}], "max_tokens": 5})
        for run in runs:
            t0 = time.perf_counter()
            conn.request("POST", f"/sessions/{run.session.id}/v1/chat/completions", body, {"Content-Type": "application/json"})
            answer = conn.getresponse().read()
            client_ms.append((time.perf_counter() - t0) * 1000)
            assert json.loads(answer)["choices"], answer
            run.end(Outcome("reward", 0.0))
        conn.close()

    thread = threading.Thread(target=client)
    thread.start()
    scheduler.serve()
    thread.join()
    gateway.close()
    rollout.sample = sample
    return [c - s * 1000 for c, s in zip(client_ms, served, strict=True)][1:]  # the first pays the connection's setup


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    set_threads(args.threads)
    rounds = 1 if args.quick else 3
    start = time.perf_counter()
    from posttrain.agents.demo import build_assets

    report = Report(
        benchmark="agent_scheduling",
        title="Multi-turn rollouts: per-trajectory scheduling vs lock-step turns; the gateway's cost per call",
        command=command_line("benchmarks.agent_scheduling", argv),
        setup=(
            f"{TRAJECTORIES} trajectories of the multi-turn demo's tiny model (hf rollout, 5 new tokens a call), trajectory i takes "
            f"1 + i % {MAX_TURNS} turns, each tool call sleeps U(0, {MAX_LATENCY_S * 1000:.0f} ms); {rounds} round(s), the two ways "
            "alternating; gateway: a keep-alive HTTP client on localhost, one call per session"
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_agents_") as tmp:
        rollout = _rollout(f"{build_assets(tmp, rows=8)}/model")
        times: dict[str, list[float]] = {"lock-step turns": [], "per-trajectory": []}
        reference = None
        for _ in range(rounds):
            for name in times:
                seconds, out = _schedule(rollout, lockstep=name == "lock-step turns")
                times[name].append(seconds)
                ids = out.batch["input_ids"].values()
                if reference is not None and not torch.equal(ids, reference):
                    raise AssertionError("the two schedules sampled different tokens")
                reference = ids
        base = statistics.median(times["lock-step turns"])
        for name, ts in times.items():
            speedup = base / statistics.median(ts)
            row = Row(name, {"rollout_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "speedup": speedup}, samples={"s": ts})
            if name == "per-trajectory":
                row.target, row.met = f">= {TARGET_SPEEDUP}x lock-step", speedup >= TARGET_SPEEDUP
            report.rows.append(row)
        overhead = _gateway_overhead(rollout, 21 if args.quick else 101)
        report.rows.append(
            Row(
                "gateway overhead per call",
                {"median_ms": statistics.median(overhead), "p90_ms": sorted(overhead)[int(0.9 * len(overhead))], "calls": len(overhead)},
                target=f"<= {TARGET_OVERHEAD_MS:g} ms median",
                met=statistics.median(overhead) <= TARGET_OVERHEAD_MS,
            )
        )
        rollout.engine.shutdown()
    report.notes.append(
        "Both schedules sampled the same tokens (each trajectory's turn t is seeded sample_seed(seed, t); the rows sharing a "
        "rollout call change a row's log-probs at float rounding only): the benchmark checks it. Lock-step waits at every turn for the "
        "slowest tool of the turn; per-trajectory scheduling overlaps one trajectory's tool with the others' sampling."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
