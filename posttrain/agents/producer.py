"""The multi-turn agent loop as a producer of RL batches (``posttrain.async_rl.producer``).

:class:`AgentProducer` is the loop (``posttrain.agents.loop.AgentLoop``) behind the
``Producer`` protocol: its budget unit is an assistant turn (``env.max_turns``), a batch's work
is an ``AgentRun`` (paused between turns across weight updates), and a run whose trajectories
have all ended is scored there and then (the environment's rewards and ``reward.function``),
so a checkpoint keeps it as a scored batch, trained as it is after a resume. A paused run is
saved as its kept samples and rebuilt by replaying them through fresh environments
(``AgentLoop.replay``); one that does not replay is generated again (warned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from posttrain.agents.loop import AgentLoop, AgentRun
from posttrain.async_rl.producer import Producer, ScoredBatch, SingleTurn


class AgentProducer:
    """Multi-turn trajectories as a producer (module docstring).

    Args:
        loop: the run's agent loop.
        max_new_tokens: the most tokens one assistant turn samples (``rollout.max_new_tokens``).
    """

    units = "turns"

    def __init__(self, loop: AgentLoop, max_new_tokens: int) -> None:
        self.loop, self.max_new_tokens = loop, max_new_tokens
        self.budget = loop.cfg.max_turns

    def settings(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "multi_turn": True, **self.loop.settings()}

    def start(self, step: int, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> AgentRun:
        return self.loop.start(metas, seeds)

    def used(self, work: AgentRun) -> int:
        return work.turn

    def finished(self, work: AgentRun) -> bool:
        return work.finished

    def advance(self, rollout, plan: Sequence[tuple[AgentRun, int | None]]) -> None:
        """Each planned run by its number of turns (None: to the end), one after the other; a run
        whose trajectories have all ended is scored at once."""
        for run, turns in plan:
            self.loop.advance(rollout, run, self.max_new_tokens, turns)
            if run.finished and run.scored is None:
                run.scored = self.loop.finish(run)

    def finish(self, work: AgentRun) -> ScoredBatch:
        if work.scored is None:
            work.scored = self.loop.finish(work)
        return work.scored

    def produce(self, rollout, prompts: list[torch.Tensor], metas: list, seeds: list[int]) -> ScoredBatch:
        return self.loop.run(rollout, metas, seeds, self.max_new_tokens)

    def save(self, work: AgentRun) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A scored run as its batch (``traj.*``, meta ``trajectories``), a paused one as its kept
        samples and digests (``run.*``, meta ``agent_run``)."""
        if work.scored is not None:
            tensors, meta = work.scored.to_tensors()
            return {f"traj.{k}": v for k, v in tensors.items()}, {"trajectories": meta}
        tensors, meta = work.to_tensors()
        return {f"run.{k}": v for k, v in tensors.items()}, {"agent_run": meta}

    def restore(self, tensors, meta, prompts: list, metas: list, seeds: list[int], max_version: int) -> AgentRun | None:
        def part(head: str) -> dict[str, torch.Tensor]:
            return {k[len(head) :]: v for k, v in tensors.items() if k.startswith(head)}

        if "trajectories" in meta:
            return AgentRun(list(metas), list(seeds), finished=True, scored=ScoredBatch.from_tensors(part("traj."), meta["trajectories"]))
        saved = AgentRun.from_tensors(part("run."), meta["agent_run"], max_version=max_version)
        if saved.seeds != [int(s) for s in seeds]:
            raise ValueError("its paused trajectories carry other seeds than the batch")
        return self.loop.replay(saved, metas)  # None: does not replay (warned): generated again

    def in_flight(self, works: Sequence[AgentRun]) -> None:
        return None  # trajectories in flight are not scored by the version-parity probe (docs/async.md)

    def close(self) -> None:
        """Stop the loop's tool worker processes."""
        self.loop.close()

    def ledger(self, work: AgentRun) -> dict[str, Any]:
        return {}


def build_producer(source, *, env, agent, reward, rollout, data, n_samples: int, log_dir: str | None) -> Producer:
    """The producer of an RL run's batches from its sections: an external agent's sessions
    behind the gateway when ``agent.function`` is set (``posttrain.gateway``: the server starts
    now, on rank 0), multi-turn trajectories when ``env.function`` is (the environment and tools
    loaded and checked now: a bad one fails before any engine), else single-turn sampling; each
    scores its batches with ``source`` (``posttrain.tasks``) and ``reward.function``.
    ``log_dir``: where the agents' output goes."""
    if agent.enabled:
        from posttrain.gateway.producer import GatewayProducer

        return GatewayProducer(agent, env, reward, rollout, data, source, log_dir, n_samples)
    if not env.enabled:
        return SingleTurn(source, rollout.max_new_tokens, rollout.temperature)
    scorer = None
    if reward.function is not None:
        scorer = (source.reward_fn, reward.function, reward.batched, reward.timeout_s)
    loop = AgentLoop(env, source.tokenizer, data.chat_template_kwargs, source.stop_ids, rollout.temperature, scorer)
    return AgentProducer(loop, rollout.max_new_tokens)


def producer_sections(cfg) -> dict:
    """The sections of an RL config :func:`build_producer` reads (``recipes.ppo.PPOConfig``)."""
    import os

    return {
        "env": cfg.env,
        "agent": cfg.agent,
        "reward": cfg.reward,
        "rollout": cfg.rollout,
        "data": cfg.data,
        "n_samples": cfg.algo.n_samples,
        "log_dir": os.path.join(cfg.trainer.output_dir, "agent_logs"),
    }
