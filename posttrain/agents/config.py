"""The ``env`` section of the RL recipe: multi-turn rollouts with an environment and tools."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from posttrain.agents.tool_runner import ISOLATION
from posttrain.agents.tools import TOOL_FORMATS

HISTORY_MISMATCH = ("error", "split")
SCHEDULES = ("per_trajectory", "lockstep")
TURN_REWARDS = ("sum", "last")
BUILTIN_ENVS = ("tools",)
OBSERVATION_OVERFLOW = ("truncate", "error")


@dataclass(frozen=True)
class EnvConfig:
    """Multi-turn agentic rollouts (``posttrain.agents``; docs/agents.md).

    Attributes:
        function: the environment: ``package.module:Name`` or ``path/to/file.py:Name`` (a
            class or factory called ``Name(prompt, **columns)`` once per trajectory), or
            ``tools`` (the built-in tool-calling environment: runs the calls of each assistant
            turn and ends at the first turn without one). null: single-turn rollouts.
        tools: tool callables by import path (``pkg.mod:fn`` or ``file.py:fn``), offered to the
            model through the chat template and executed by the ``tools`` environment
            (an environment's own ``tools`` attribute adds to them).
        tool_format: how tool calls are written: ``hermes`` (``<tool_call>{json}</tool_call>``,
            Qwen / Hermes), ``llama3`` (Llama 3.1 JSON calls) or ``auto`` (read off the chat
            template; refused at build when it names neither).
        max_turns: assistant turns per trajectory, >= 1.
        max_tokens: the longest token sequence of a training sample (prompt, every turn and
            every observation); a trajectory that reaches it ends, flagged truncated.
        tool_timeout_s: seconds one tool call may take; past it the call is stopped (in a
            worker process: killed; in a thread: abandoned, see ``tool_isolation``) and the
            model sees an error observation; null: no limit.
        tool_isolation: where tool calls run (``posttrain.agents.tool_runner``): ``process``
            (tools named by import path in ``env.tools`` run in worker processes, stopped past
            their time; an environment's own ``tools`` attribute runs in threads) or ``thread``
            (every call in a thread of the trainer, abandoned past its time).
        tool_concurrency: tool calls of one turn (over every trajectory) run at once, at most
            this many (also the number of worker processes kept).
        tool_turn_timeout_s: the deadline of one turn's tool calls together; a call that could
            not start or finish by then is an error observation; null: none.
        max_abandoned_tools: thread calls past their time still running, above which the run
            stops naming the tools (they hold the trainer's cores).
        max_observation_chars: the most characters of one observation (its messages' content,
            a tool result included) that reach the chat template; the rest is cut before the
            template and the tokenizer run. null: ``2 * max_tokens * (the tokenizer's longest
            token in characters)``, more than any observation that fits ``max_tokens`` can use,
            so cutting changes no trajectory (one that long ends at the budget either way).
        observation_overflow: an observation over ``max_observation_chars``: ``truncate`` (cut,
            counted in ``env/observations_truncated``) or ``error`` (the run stops naming the
            environment, the row and the turn).
        step_timeout_s: seconds the environment's own ``step`` (or construction) may take; past
            it the run stops naming ``env.function``; null: no limit.
        history_mismatch: when the chat template renders the conversation so far differently
            from the tokens kept (a template that rewrites history, e.g. drops earlier
            reasoning): ``error`` (stop, naming the turn and the first differing token) or
            ``split`` (the trajectory's next turns start a new training sample whose prompt is
            the re-rendered conversation).
        schedule: how the trajectories' model calls are served (``posttrain.agents.scheduler``):
            ``per_trajectory`` (each trajectory asks for its next call as soon as it is ready and
            the rollout serves whatever waits: no trajectory waits for another's tools; which
            calls share a rollout call depends on timing, so reruns agree to float rounding of
            the rollout's log-probs) or ``lockstep`` (a turn's calls are served together once
            every trajectory has asked: reruns and resumes bit-identical, each turn as slow as
            its slowest tool). Also the gateway's sessions (``agent.function``).
        turn_rewards: how the environment's per-turn rewards combine: ``sum`` or ``last``;
            ``reward.function`` (when set) adds its score of the final answer.
        observation_role: the chat role of an observation given as plain text (``user``, or
            e.g. ``tool`` / ``environment`` where the template knows it).
    """

    function: str | None = None
    tools: list[str] = field(default_factory=list)
    tool_format: str = "auto"
    max_turns: int = 4
    max_tokens: int = 1024
    tool_timeout_s: float | None = 30.0
    tool_isolation: str = "process"
    tool_concurrency: int = 8
    tool_turn_timeout_s: float | None = 120.0
    max_abandoned_tools: int = 4
    max_observation_chars: int | None = None
    observation_overflow: str = "truncate"
    step_timeout_s: float | None = 300.0
    history_mismatch: str = "error"
    schedule: str = "per_trajectory"
    turn_rewards: str = "sum"
    observation_role: str = "user"

    @property
    def enabled(self) -> bool:
        return self.function is not None

    def _problems(self) -> list[str]:
        out = []
        for key, spec in [("function", self.function)] * (self.function not in (None, *BUILTIN_ENVS)) + [("tools", t) for t in self.tools]:
            module, sep, name = str(spec).rpartition(":")
            if not sep or not module or not name:
                out.append(f"{key} = {spec!r}: expected 'package.module:Name' or 'path/to/file.py:Name'; fix: add ':Name'")
            elif (module.endswith(".py") or "/" in module) and not os.path.isfile(module):
                out.append(f"{key} = {spec!r}: file {module!r} does not exist (working directory {os.getcwd()}); fix: give its path")
        if self.tools and self.function is None:
            out.append("tools: given without env.function; fix: env.function=tools (the built-in tool environment) or your environment")
        if self.tool_format not in TOOL_FORMATS:
            out.append(f"tool_format = {self.tool_format!r}: unknown; fix: one of {', '.join(TOOL_FORMATS)}")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            out.append(f"max_turns = {self.max_turns!r}: must be an integer >= 1; fix: e.g. 4")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 2:
            out.append(f"max_tokens = {self.max_tokens!r}: must be an integer >= 2; fix: e.g. 1024")
        if self.tool_isolation not in ISOLATION:
            out.append(f"tool_isolation = {self.tool_isolation!r}: unknown; fix: one of {', '.join(ISOLATION)}")
        for key, least in (("tool_concurrency", 1), ("max_abandoned_tools", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                out.append(f"{key} = {value!r}: must be an integer >= {least}; fix: e.g. {least + 3}")
        chars = self.max_observation_chars
        if chars is not None and (isinstance(chars, bool) or not isinstance(chars, int) or chars < 1):
            out.append(f"max_observation_chars = {chars!r}: must be an integer >= 1 or null (derived from max_tokens); fix: e.g. 8192")
        if self.observation_overflow not in OBSERVATION_OVERFLOW:
            out.append(f"observation_overflow = {self.observation_overflow!r}: unknown; fix: one of {', '.join(OBSERVATION_OVERFLOW)}")
        for key in ("tool_timeout_s", "tool_turn_timeout_s", "step_timeout_s"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                out.append(f"{key} = {value!r}: must be > 0 seconds or null (no limit); fix: e.g. 30")
        if self.history_mismatch not in HISTORY_MISMATCH:
            out.append(f"history_mismatch = {self.history_mismatch!r}: unknown; fix: one of {', '.join(HISTORY_MISMATCH)}")
        if self.schedule not in SCHEDULES:
            out.append(f"schedule = {self.schedule!r}: unknown; fix: one of {', '.join(SCHEDULES)}")
        if self.turn_rewards not in TURN_REWARDS:
            out.append(f"turn_rewards = {self.turn_rewards!r}: unknown; fix: one of {', '.join(TURN_REWARDS)}")
        if not isinstance(self.observation_role, str) or not self.observation_role:
            out.append(f"observation_role = {self.observation_role!r}: must be a chat role; fix: e.g. user")
        return out


def multi_turn_problems(env: EnvConfig, from_files: bool, legacy_flag, max_model_len: int | None) -> list[str]:
    """What multi-turn rollouts (``env.function``) cannot run with in an RL recipe, each named:
    ``from_files`` (the data has a tokenizer and chat template), the legacy-worker flag
    (``trainer.use_legacy_worker_impl``) and ``rollout.max_model_len``."""
    if not env.enabled:
        return []
    from roles.legacy_flag import FLAG_VALUES, use_legacy

    out = []
    if not from_files:
        out.append(
            f"env.function = {env.function!r}: multi-turn rollouts need a tokenizer with a chat template (the sorting task has "
            "none); fix: give data.train_files and engine.model.path"
        )
    if legacy_flag in FLAG_VALUES and use_legacy(legacy_flag):
        out.append(
            "trainer.use_legacy_worker_impl: the legacy workers train single-turn batches only, not env.function's multi-turn "
            "trajectories; fix: trainer.use_legacy_worker_impl=auto"
        )
    if max_model_len is not None and max_model_len < env.max_tokens:
        out.append(
            f"env.max_tokens = {env.max_tokens} > rollout.max_model_len = {max_model_len}: a trajectory could outgrow the "
            "rollout engine; fix: lower env.max_tokens or raise rollout.max_model_len"
        )
    return out
