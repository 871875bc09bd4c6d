"""The environment interface of multi-turn rollouts, and the built-in tool environment.

An environment is user code named by ``env.function`` (``package.module:Name`` or
``path/to/file.py:Name``, loaded like reward functions). ``Name(prompt, **columns)`` is called
once per trajectory, with the rendered prompt the model sees and every other column of the
data row, and returns an object with

* ``step(turn: Turn) -> StepResult``: answers one assistant turn: the observation the model
  sees next (a string, sent as one message of ``env.observation_role``; a message dict or a
  list of them, e.g. ``{"role": "tool", "content": ...}``; None only with ``done``), a reward
  contribution and whether the trajectory is done;
* optionally ``tools``: callables offered to the model besides ``env.tools``
  (``posttrain.agents.tools``).

Tools are run by the loop, not by the environment: when the environment has tools (``env.tools``
or its own ``tools``), each turn's calls are executed before ``step`` (concurrently over the
turn's trajectories, bounded and stopped past their time: ``posttrain.agents.tool_runner``) and
handed to it as ``Turn.tool_results``, one per call in order; ``step`` decides what the model
sees (the built-in ``tools`` environment sends them back as ``tool`` messages). The loop counts
their errors; ``StepResult.tool_errors`` adds errors the environment reports itself.

The ``columns`` an environment gets are its own deep copy of the row: changing them changes no
other trajectory, the reward function's view, or a later epoch.

It runs on rank 0 only (its observations reach the other ranks as tokens), bounded by
``env.step_timeout_s``; anything it raises, ``sys.exit`` included, a timeout, or a result that is
not a :class:`StepResult` (or a ``(observation, reward, done)`` tuple) of the right types stops
the run with an error naming ``env.function`` and the row, before any update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.agents.tools import ToolCall, ToolResult


@dataclass(frozen=True)
class Turn:
    """One assistant turn, as the environment sees it.

    Attributes:
        index: the turn's index in the trajectory (0 first).
        text: the sampled text, decoded with special tokens (tool-call markup is often one),
            an ending stop token (e.g. the end-of-turn token) left out.
        tool_calls: the calls parsed from it in ``env.tool_format`` (malformed ones carry
            their ``error``).
        truncated: the turn ended at its length cap (no stop token).
        tool_results: with tools, each call's result in order (module docstring); else empty.
    """

    index: int
    text: str
    tool_calls: Sequence[ToolCall] = ()
    truncated: bool = False
    tool_results: Sequence[ToolResult] = ()


@dataclass(frozen=True)
class StepResult:
    """An environment's answer to one turn (module docstring).

    Attributes:
        observation: what the model sees next (str, a message dict, a list of them, or None).
        reward: this turn's reward contribution (``env.turn_rewards`` combines them).
        done: the trajectory ends after this turn.
        tool_errors: error observations the environment itself put in it, an integer >= 0
            (the loop counts the tool results' own; both in ``env/tool_errors_sum``).
    """

    observation: str | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None
    reward: float = 0.0
    done: bool = False
    tool_errors: int = 0
    info: Mapping[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """What ``env.function`` builds (module docstring)."""

    def step(self, turn: Turn) -> StepResult: ...


class ToolEnv:
    """``env.function: tools``: each assistant turn's tool results (the loop ran its calls:
    module docstring) are sent back as ``tool`` messages, in call order; a turn without calls
    is the final answer (done, reward 0: ``reward.function`` scores it). A malformed call, an
    unknown tool or a failing one is an error observation the model sees, counted, never a crash.

    Args:
        prompt: the rendered prompt (unused).
    """

    def __init__(self, prompt: str, **columns: Any) -> None:
        pass

    def step(self, turn: Turn) -> StepResult:
        if not turn.tool_calls:
            return StepResult(None, 0.0, True)
        return StepResult([{"role": "tool", "name": r.name or "unknown", "content": r.content} for r in turn.tool_results], 0.0, False)
