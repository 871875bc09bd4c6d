"""External agents as a producer of RL batches (``posttrain.async_rl.producer``): each trajectory is
a gateway session driven by the user's agent (``agent.function``), its model calls served by the
per-trajectory scheduler (``posttrain.agents.scheduler``).

A batch's work is its sessions (one per response: ``algo.n_samples`` per row, a GRPO group). Its
budget unit is a model call (``agent.max_calls``): a round grants each live session that many
more calls and serves them until every session has used its grant (its next call waits for the
next round, after the weight update) or its agent has ended; a session may so span weight
versions, each token keeping the version that sampled it (staleness counts from the oldest). A
batch is finished when every session's agent has returned; it is scored then: the agent's reward,
or ``reward.function`` on the answer it returned (or on the last assistant message). Failed
sessions (raised, timed out, exited, no model call, not a reward) are left out as
``agent.on_failure`` says, counted, never scored 0.

Checkpoints: a batch's finished sessions are saved with their tokens and outcomes; on resume they
are trained as they were and every unfinished session is started again from its row with a new
session (an external agent cannot be replayed: docs/agents.md).
"""

from __future__ import annotations

import secrets
import statistics
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine_api.dist import is_initialized
from posttrain.agents.loop import _DTYPES, _on_rank0, scored_batch, trajectory_rows
from posttrain.agents.scheduler import CallScheduler
from posttrain.agents.tools import detect_format
from posttrain.async_rl.producer import ScoredBatch
from posttrain.gateway.agents import AgentRunner, Outcome
from posttrain.gateway.server import Gateway, SessionRun
from posttrain.gateway.session import Session, SessionLimits
from posttrain.rewards import compute_rewards


@dataclass
class Sessions:
    """One batch's sessions in flight (rank 0 holds the sessions; every rank the counters).

    Attributes:
        metas, seeds: per trajectory its row and seed.
        runs: per trajectory its live session (None: not started yet, or restored finished).
        restored: per trajectory restored from a checkpoint: its rows and outcome.
        restarted: trajectories a checkpoint held unfinished, started again after the resume.
        granted: calls granted per session so far (the budget used).
        finished: every session has ended (agreed by every rank).
        scored: the finished batch, once scored.
    """

    metas: list
    seeds: list[int]
    runs: list[SessionRun | None] = field(default_factory=list)
    restored: dict[int, dict[str, Any]] = field(default_factory=dict)
    restarted: list[int] = field(default_factory=list)
    granted: int = 0
    finished: bool = False
    scored: ScoredBatch | None = None


class GatewayProducer:
    """Sessions of external agents as RL batches (module docstring).

    Args:
        agent: the ``agent`` section.
        env: the ``env`` section (the token rules: ``max_tokens``, ``history_mismatch``,
            ``tool_format``).
        reward: the ``reward`` section.
        rollout: the ``rollout`` section (``max_new_tokens``, sampling settings).
        data: the ``data`` section (``chat_template_kwargs``).
        source: the task (tokenizer, stop ids, ``reward_fn``).
        log_dir: where the agents' stderr goes.
        n_samples: sessions per row (a GRPO group).
    """

    units = "calls"

    def __init__(self, agent, env, reward, rollout, data, source, log_dir: str | None, n_samples: int = 1) -> None:
        self.cfg, self.env, self.reward, self.rollout_cfg, self.n_samples = agent, env, reward, rollout, n_samples
        self.source, self.budget = source, agent.max_calls
        tok = source.tokenizer
        fmt = env.tool_format if env.tool_format != "auto" else detect_format(getattr(tok, "chat_template", None))
        self.limits = SessionLimits(
            max_tokens=env.max_tokens,
            max_new_tokens=rollout.max_new_tokens,
            max_calls=agent.max_calls,
            history_mismatch=env.history_mismatch,
            tool_format=fmt,
            strict_sampling=agent.request_sampling == "strict",
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            model_name=agent.model_name,
        )
        self.template_kwargs = dict(data.chat_template_kwargs)
        self.prompt_key = getattr(data, "prompt_key", "prompt")
        self.rank0 = not is_initialized() or dist.get_rank() == 0
        self._lock = threading.Lock()
        self.gateway: Gateway | None = None
        self.runner: AgentRunner | None = None
        if self.rank0:
            if not getattr(tok, "chat_template", None):
                raise ValueError("agent.function: the gateway renders every call with the tokenizer's chat template, and it has none")
            self.gateway = Gateway(agent.host, agent.port, agent.max_body_bytes, agent.model_name, 2 * agent.max_concurrency + 8)
            self.gateway.start()
            self.runner = AgentRunner(agent.function, agent.max_concurrency, agent.timeout_s, log_dir)

    def settings(self) -> dict[str, Any]:
        keys = {"function": self.cfg.function, "max_calls": self.cfg.max_calls, "on_failure": self.cfg.on_failure}
        env = {"max_tokens": self.env.max_tokens, "history_mismatch": self.env.history_mismatch}
        return {
            "max_new_tokens": self.limits.max_new_tokens,
            **{f"agent.{k}": v for k, v in keys.items()},
            **{f"env.{k}": v for k, v in env.items()},
        }

    # ------------------------------------------------------------------ the protocol
    def start(self, step: int, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> Sessions:
        return Sessions(list(metas), [int(s) for s in seeds], [None] * len(metas))

    def used(self, work: Sessions) -> int:
        return work.granted

    def finished(self, work: Sessions) -> bool:
        return work.finished

    def advance(self, rollout, plan: Sequence[tuple[Sessions, int | None]]) -> None:
        """Grant each planned batch's live sessions their calls, start the agents not started,
        and serve their calls until every one has used its grant or ended. Collective."""
        scheduler = CallScheduler(rollout, lockstep=self.env.schedule == "lockstep")
        if self.rank0:
            for work, units in plan:
                for i in range(len(work.metas)):
                    if i in work.restored:
                        continue
                    run = work.runs[i] or self._open(work, i)
                    run.grant(units, scheduler)
                    if not run.launched:
                        run.launched = True
                        self.runner.submit(run.base_url, self._row(work.metas[i]), run.end)
            scheduler.serve()
        else:
            scheduler.follow()
        for work, units in plan:
            work.granted = self.budget if units is None else work.granted + units
            work.finished = _on_rank0(lambda work=work: all(r is None or r.finished for r in work.runs) and self._all_started(work))

    def finish(self, work: Sessions) -> ScoredBatch:
        if work.scored is None:
            work.scored = self._score(work)
            if self.gateway is not None:  # the batch is scored: its sessions' state goes
                self.gateway.retire(r.session.id for r in work.runs if r is not None)
        return work.scored

    def produce(self, rollout, prompts, metas, seeds) -> ScoredBatch:
        work = self.start(0, prompts, metas, seeds)
        self.advance(rollout, [(work, None)])
        return self.finish(work)

    def save(self, work: Sessions) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The finished sessions' tokens and outcomes (an unfinished one starts again on resume)."""
        done = {i: r for i, r in enumerate(work.runs) if r is not None and r.finished}
        kept = sorted(done)
        rows = trajectory_rows([done[i].session.trajectory for i in kept if done[i].session.trajectory is not None]) if kept else None
        meta = {
            "finished": {
                str(i): {
                    "kind": done[i].outcome.kind,
                    "value": done[i].outcome.value,
                    "error": done[i].outcome.error,
                    "calls": done[i].session.calls,
                    "prompt": done[i].session.prompt_text,
                    "answer": done[i].session.last_answer(),
                    "has_tokens": done[i].session.trajectory is not None,
                }
                for i in kept
            },
            "restored": {str(i): {k: v for k, v in r.items() if k != "rows"} for i, r in work.restored.items()},
            "granted": work.granted,
        }
        return _pack_rows(rows, [i for i in kept if done[i].session.trajectory is not None]), meta

    def restore(self, tensors, meta, prompts, metas, seeds, max_version) -> Sessions:
        work = self.start(0, prompts, metas, seeds)
        rows = _unpack_rows(tensors)
        for key, info in {**meta.get("restored", {}), **meta["finished"]}.items():
            i = int(key)
            work.restored[i] = {**info, "rows": rows.get(i)}
        work.restarted = [i for i in range(len(metas)) if i not in work.restored]
        return work

    def in_flight(self, works) -> None:
        return None

    def ledger(self, work: Sessions) -> dict[str, Any]:
        """Which sessions a resume kept (finished before the checkpoint: trained as they were)
        and which it started again (an external agent cannot be replayed)."""
        if not work.restored and not work.restarted:
            return {}
        return {"sessions_kept": sorted(work.restored), "sessions_restarted": list(work.restarted)}

    def close(self) -> None:
        """Stop the agents and the gateway."""
        if self.runner is not None:
            self.runner.close()
        if self.gateway is not None:
            self.gateway.close()

    # ------------------------------------------------------------------ internals
    def _open(self, work: Sessions, i: int) -> SessionRun:
        sid = secrets.token_urlsafe(24)
        session = Session(
            sid,
            work.metas[i],
            work.seeds[i],
            self.source.tokenizer,
            self.template_kwargs,
            list(self.source.stop_ids),
            self.limits,
            self._lock,
        )
        # Its place among the calls served with it: fixed by the data (its seed), as a resume has it.
        run = SessionRun(session, self.gateway.url(sid), order=(work.seeds[i], i))
        self.gateway.sessions[sid] = run
        work.runs[i] = run
        return run

    def _row(self, meta) -> dict[str, Any]:
        """What the agent gets as keyword arguments: the row's columns, the prompt column (under
        its name, ``data.prompt_key``) as the file has it."""
        prompt = meta.prompt if getattr(meta, "prompt", None) is not None else meta.text
        return {self.prompt_key: prompt, **dict(meta.columns)}

    @staticmethod
    def _all_started(work: Sessions) -> bool:
        return all(r is not None or i in work.restored for i, r in enumerate(work.runs))

    def _score(self, work: Sessions) -> ScoredBatch:
        """The batch of the sessions kept (``agent.on_failure``), each scored. Collective."""
        n = len(work.metas)

        def plan() -> dict[str, Any]:
            outcomes = {i: self._outcome(work, i) for i in range(n)}
            failed = {i for i, o in outcomes.items() if not o["ok"]}
            groups_of = {i: i // max(1, self.n_samples) for i in range(n)}
            bad_groups = {groups_of[i] for i in failed}
            kept = [i for i in range(n) if i not in failed and (self.cfg.on_failure == "drop_session" or groups_of[i] not in bad_groups)]
            if not kept:
                errors = "; ".join(f"session {i}: {outcomes[i]['error']}" for i in sorted(failed)[:3])
                raise RuntimeError(
                    f"agent.function = {self.cfg.function!r}: every session of the batch failed ({len(failed)} of {n}; {errors}); "
                    f"nothing to train; the agents' output is in {self.runner.log_path}"
                )
            rows = self._rows(work, kept)
            return {"outcomes": outcomes, "kept": kept, "rows": rows, "groups": [groups_of[i] for i in kept]}

        info = _on_rank0(plan)
        kept, outcomes = info["kept"], info["outcomes"]
        scores = torch.tensor([float(outcomes[i]["value"]) if outcomes[i]["kind"] == "reward" else 0.0 for i in kept], dtype=torch.float64)
        asks = [k for k, i in enumerate(kept) if outcomes[i]["kind"] != "reward"]
        if asks:
            if self.reward.function is None:
                raise RuntimeError(
                    f"agent.function = {self.cfg.function!r} returned no reward for {len(asks)} session(s) and reward.function is "
                    "unset; fix: return a number from the agent, or set reward.function to score its answer"
                )
            metas = [work.metas[kept[k]] for k in asks]
            prompts = [outcomes[kept[k]]["prompt"] for k in asks]
            answers = [outcomes[kept[k]]["answer"] for k in asks]
            columns = [dict(m.columns) for m in metas] if self.rank0 else [{}] * len(asks)
            fn_scores = compute_rewards(
                self.source.reward_fn,
                self.reward.batched,
                prompts,
                answers,
                columns,
                [m.source for m in metas],
                name=self.reward.function,
                timeout_s=self.reward.timeout_s,
            )
            scores[asks] = fn_scores
        texts = []
        if self.rank0:
            texts = [
                {"prompt": outcomes[i]["prompt"], "response": outcomes[i]["response"], "reward": float(r)}
                for i, r in zip(kept, scores.tolist(), strict=True)
            ]
        out = scored_batch(info["rows"], scores, self.rollout_cfg.temperature, texts, groups=torch.tensor(info["groups"], dtype=torch.long))
        calls = [outcomes[i]["calls"] for i in range(n)]
        out.metrics.update(
            {
                "agent/sessions": float(n),
                "agent/calls_mean": statistics.mean(calls),
                "agent/calls_max": float(max(calls)),
                "agent/failures": float(sum(o["kind"] == "failed" for o in outcomes.values())),
                "agent/timeouts": float(sum(o["kind"] == "timeout" for o in outcomes.values())),
                "agent/dropped": float(n - len(kept)),
                "agent/sampling_overrides": float(sum(o["overrides"] for o in outcomes.values())),
            }
        )
        return out

    def _outcome(self, work: Sessions, i: int) -> dict[str, Any]:
        if i in work.restored:
            r = work.restored[i]
            ok = r["kind"] in ("reward", "answer", "none") and r["calls"] > 0
            return {**r, "ok": ok, "response": r.get("response", r["answer"]), "overrides": 0}
        run = work.runs[i]
        o: Outcome = run.outcome or Outcome("failed", error="never ended")
        s = run.session
        error = o.error
        ok = o.ok and s.calls > 0
        if o.ok and not s.calls:
            error = "returned without calling the model"
        if o.ok and o.kind == "answer" and not isinstance(o.value, str):
            ok, error = False, "returned an answer that is not text"
        t = s.trajectory
        response = t.text[len(s.prompt_text) :] if t is not None and t.text.startswith(s.prompt_text) else (t.text if t else "")
        answer = o.value if o.kind == "answer" else s.last_answer()
        kind = o.kind if ok or o.kind == "timeout" else "failed"
        return {
            "kind": kind,
            "value": o.value,
            "error": error,
            "calls": s.calls,
            "prompt": s.prompt_text,
            "answer": answer,
            "response": response,
            "ok": ok,
            "overrides": s.overrides,
        }

    def _rows(self, work: Sessions, kept: list[int]):
        """The training rows of the kept trajectories (restored ones from their saved rows)."""
        live = []
        for i in kept:
            if i in work.restored:
                live.append(_RestoredTrajectory(work.restored[i]["rows"]))
            else:
                t = work.runs[i].session.trajectory
                t.calls = sum(len(a.calls) for a in work.runs[i].session.answers)
                live.append(t)
        return trajectory_rows(live)


class _RestoredTrajectory:
    """A finished session's saved rows, standing in for its trajectory in ``trajectory_rows``."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self._segments = rows["segments"]
        self.turns, self.calls, self.errors, self.cut_observations = rows["turns"], rows["calls"], 0, 0
        self.truncated, self.splits = bool(rows["truncated"]), len(self._segments) - 1

    def segments(self):
        return self._segments


@dataclass
class _Segment:
    ids: list[int]
    prompt_len: int
    mask: list[float]
    log_probs: list[float]
    versions: list[int]
    turns: list[int]
    routing: torch.Tensor | None = None

    def routed_experts(self):
        return self.routing


def _pack_rows(rows, owners: list[int]) -> dict[str, torch.Tensor]:
    """Finished trajectories' rows as flat tensors (``owner``: each row's trajectory index)."""
    if rows is None:
        return {}
    segments, traj_of_row, prompt_lens, truncated, _, routing = rows
    out = {k: torch.cat([torch.tensor(v, dtype=d) for v in segments[k]]) for k, d in _DTYPES.items()}
    out["lengths"] = torch.tensor([len(v) for v in segments["ids"]], dtype=torch.long)
    out["owner"] = torch.tensor([owners[t] for t in traj_of_row], dtype=torch.long)
    out["prompt_len"] = torch.tensor(prompt_lens, dtype=torch.long)
    out["truncated"] = torch.tensor(truncated, dtype=torch.long)
    if routing:
        out["routing"] = torch.cat(routing)
    return out


def _unpack_rows(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, Any]]:
    """Per trajectory index: its saved segments and counters (``_pack_rows`` inverted)."""
    if not tensors:
        return {}
    lengths = tensors["lengths"].tolist()
    cols = {k: tensors[k].split(lengths) for k in _DTYPES}
    routing = tensors["routing"].split(lengths) if "routing" in tensors else [None] * len(lengths)
    out: dict[int, dict[str, Any]] = {}
    for r, owner in enumerate(tensors["owner"].tolist()):
        seg = _Segment(
            cols["ids"][r].tolist(),
            int(tensors["prompt_len"][r]),
            cols["loss_mask"][r].tolist(),
            cols["rollout_log_probs"][r].tolist(),
            cols["rollout_token_versions"][r].tolist(),
            cols["turns"][r].tolist(),
            routing[r],
        )
        entry = out.setdefault(owner, {"segments": [], "truncated": int(tensors["truncated"][r]), "calls": 0})
        entry["segments"].append(seg)
        entry["turns"] = max([t for s in entry["segments"] for t in s.turns] + [-1]) + 1
    return out
