"""The ``agent`` section of the RL recipe: train an agent written against an OpenAI-style API."""

from __future__ import annotations

import os
from dataclasses import dataclass

ON_FAILURE = ("drop_group", "drop_session")
REQUEST_SAMPLING = ("run", "strict")


@dataclass(frozen=True)
class AgentConfig:
    """An external agent behind the OpenAI-compatible gateway (``posttrain.gateway``;
    docs/agents.md#agents-behind-an-openai-api).

    Attributes:
        function: the agent: ``package.module:run`` or ``path/to/file.py:run``, an ``async`` or
            plain function ``run(base_url, **row)`` called once per trajectory (session) with
            the session's OpenAI ``base_url`` and the data row's columns by name. It returns a
            reward (a number), the final answer for ``reward.function`` to score (a string), or
            None (``reward.function`` scores the last assistant message). null: no gateway.
        max_concurrency: agents running at once, each in a worker process of its own (one that
            exits, hangs or holds the GIL cannot stop or slow the trainer).
        timeout_s: seconds one session (the agent function's whole call) may take; past it
            its process is killed and the session counts in ``agent/timeouts``.
        max_calls: model calls one session may make; one past it is answered with an error.
        on_failure: a session whose agent raised, timed out, exited, returned something that is
            not a reward, or never called the model: ``drop_group`` (its GRPO group, the ``n``
            sessions of its row, is left out of the step) or ``drop_session`` (only it).
        host: the address the gateway listens on (localhost: agents run on this machine).
        port: its port; 0 picks a free one.
        max_body_bytes: the largest request body accepted (413 past it).
        request_sampling: a request's own ``temperature`` / ``top_p`` / ``top_k``: ``run`` (the
            run's rollout settings apply, the request's are ignored and counted in
            ``agent/sampling_overrides``: the policy trained is the one sampled) or ``strict``
            (a request asking for other values is refused, naming them).
        model_name: the model id ``/v1/models`` lists (a request may name any model).
    """

    function: str | None = None
    max_concurrency: int = 8
    timeout_s: float = 600.0
    max_calls: int = 16
    on_failure: str = "drop_group"
    host: str = "127.0.0.1"
    port: int = 0
    max_body_bytes: int = 4 * 2**20
    request_sampling: str = "run"
    model_name: str = "enginekit-policy"

    @property
    def enabled(self) -> bool:
        return self.function is not None

    def _problems(self) -> list[str]:
        out = []
        if self.function is not None:
            module, sep, name = str(self.function).rpartition(":")
            if not sep or not module or not name:
                out.append(f"function = {self.function!r}: expected 'package.module:run' or 'path/to/file.py:run'; fix: add ':run'")
            elif (module.endswith(".py") or "/" in module) and not os.path.isfile(module):
                out.append(
                    f"function = {self.function!r}: file {module!r} does not exist (working directory {os.getcwd()}); fix: give its path"
                )
        for key, least in (("max_concurrency", 1), ("max_calls", 1), ("max_body_bytes", 1024), ("port", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                out.append(f"{key} = {value!r}: must be an integer >= {least}; fix: e.g. {max(least, 8)}")
        if not self.timeout_s > 0:
            out.append(f"timeout_s = {self.timeout_s!r}: must be > 0 seconds; fix: e.g. 600")
        if self.on_failure not in ON_FAILURE:
            out.append(f"on_failure = {self.on_failure!r}: unknown; fix: one of {', '.join(ON_FAILURE)}")
        if self.request_sampling not in REQUEST_SAMPLING:
            out.append(f"request_sampling = {self.request_sampling!r}: unknown; fix: one of {', '.join(REQUEST_SAMPLING)}")
        return out


def gateway_problems(cfg) -> list[str]:
    """What an RL config with ``agent.function`` cannot run with, each named (its ``env``,
    ``data``, ``async``, ``algo``, ``rollout`` and ``trainer`` sections)."""
    agent = cfg.agent
    if not agent.enabled:
        return []
    out = []
    if cfg.env.enabled:
        out.append(
            f"agent.function = {agent.function!r} and env.function = {cfg.env.function!r}: a trajectory is driven by one of them; "
            "fix: drop env.function (the agent runs its own tools) or agent.function"
        )
    if not cfg.data.from_files:
        out.append(
            "agent.function: the gateway renders calls with the model's chat template; fix: give data.train_files and engine.model.path"
        )
    flag = cfg.trainer.use_legacy_worker_impl
    if flag in (True, "enable"):
        out.append(
            "trainer.use_legacy_worker_impl: the legacy workers train single-turn batches only; fix: trainer.use_legacy_worker_impl=auto"
        )
    if cfg.rollout.max_model_len is not None and cfg.rollout.max_model_len < cfg.env.max_tokens:
        out.append(
            f"env.max_tokens = {cfg.env.max_tokens} > rollout.max_model_len = {cfg.rollout.max_model_len}: a session could outgrow "
            "the rollout engine; fix: lower env.max_tokens or raise rollout.max_model_len"
        )
    k, per_step = cfg.async_.max_staleness, cfg.data.batch_size * cfg.algo.n_samples
    if k and cfg.async_.partial_rollouts and agent.max_concurrency < (k + 1) * per_step:
        out.append(
            f"agent.max_concurrency = {agent.max_concurrency}: with async.max_staleness = {k} and partial rollouts a session pauses "
            f"between calls while its agent's process waits, so the {k + 1} batches in flight ({(k + 1) * per_step} sessions) must all "
            f"run at once; fix: agent.max_concurrency={(k + 1) * per_step}, or async.partial_rollouts=false"
        )
    return out
