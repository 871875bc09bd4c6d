"""Running the tool calls of a turn: concurrently, bounded, and stoppable.

:class:`ToolRunner` runs a turn's tool calls (every trajectory's, one list) at most
``env.tool_concurrency`` at a time, each bounded by ``env.tool_timeout_s`` and all of them by the
turn's deadline ``env.tool_turn_timeout_s`` (a call that could not start or finish by then is an
error observation). Where a call runs (``env.tool_isolation``):

* ``process`` (default): a tool named by an import path (``env.tools``) runs in a worker process
  (``posttrain.agents.tool_worker``; one per concurrent call, kept between turns). A call past
  its time is stopped: its worker's process group is killed (a busy loop, a call holding the
  GIL, a child process it started) and a fresh worker takes its place. A tool that is a Python
  object only (an environment's own ``tools`` attribute, e.g. a bound method holding state)
  cannot move to another process and runs in a thread, as below.
* ``thread``: every call runs in a daemon thread of the trainer. One past its time is
  abandoned (a thread cannot be stopped); abandoned calls still running are counted, and past
  ``env.max_abandoned_tools`` of them the run stops naming the tools (they hold the trainer's
  cores and, holding the GIL, its Python).

Whatever a tool raises (``sys.exit`` included), a result whose ``str`` raises, a worker that
dies, an unknown tool and bad arguments are error observations the model sees, counted in
``env/tool_errors_sum``; nothing a tool does stops the run, but for the abandoned-thread bound.
A result longer than the observation bound is cut there (``ToolResult.truncated``).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from posttrain.agents.tool_worker import content_of
from posttrain.agents.tools import ToolCall, ToolResult, call_problem
from posttrain.workers import Exited, Timeout, WorkerPool

ISOLATION = ("process", "thread")


@dataclass(frozen=True)
class Tool:
    """A callable offered to the model: ``fn`` (the schema and argument checks read it) and
    ``spec``, its import path, when it can run in a worker process (None: a thread)."""

    name: str
    fn: Callable[..., object]
    spec: str | None = None


class ToolRunner:
    """Runs tool calls (module docstring).

    Args:
        timeout_s: ``env.tool_timeout_s`` (None: no limit on one call).
        concurrency: ``env.tool_concurrency``: calls at once (and worker processes).
        turn_timeout_s: ``env.tool_turn_timeout_s`` (None: no deadline for a turn's calls).
        isolation: ``env.tool_isolation``.
        max_abandoned: ``env.max_abandoned_tools``.
    """

    def __init__(
        self,
        timeout_s: float | None,
        concurrency: int = 8,
        turn_timeout_s: float | None = None,
        isolation: str = "process",
        max_abandoned: int = 4,
    ) -> None:
        self.timeout_s, self.concurrency, self.turn_timeout_s = timeout_s, concurrency, turn_timeout_s
        self.isolation, self.max_abandoned = isolation, max_abandoned
        self._pool = WorkerPool("posttrain.agents.tool_worker", name="tool") if isolation == "process" else None
        self._abandoned: list[tuple[threading.Thread, str]] = []
        self._abandoned_lock = threading.Lock()  # trajectories' threads run calls at the same time
        # Workers stop with the runner, or at interpreter exit at the latest.
        self._finalizer = weakref.finalize(self, WorkerPool.close, self._pool) if self._pool is not None else None

    def run(self, jobs: Sequence[tuple[ToolCall, Mapping[str, Tool]]], max_chars: Sequence[int]) -> list[ToolResult]:
        """The results of ``jobs`` (each a call and the registry it may use), in order, every
        result at most ``max_chars[i]`` characters.

        Raises:
            RuntimeError: more than ``max_abandoned`` abandoned tool threads are still running.
        """
        deadline = None if self.turn_timeout_s is None else time.monotonic() + self.turn_timeout_s
        results: list[ToolResult | None] = [None] * len(jobs)
        runnable = []
        for i, (call, registry) in enumerate(jobs):
            checked = _check(call, registry)
            if isinstance(checked, ToolResult):
                results[i] = checked
            else:
                runnable.append((i, checked, call))
        if runnable:
            # Daemon threads, not an executor: an executor's threads are joined at interpreter
            # exit, so one blocked on a tool without a time limit would hang the exit.
            todo: queue.SimpleQueue = queue.SimpleQueue()
            for item in runnable:
                todo.put(item)
            failures: list[BaseException] = []

            def drain() -> None:
                while True:
                    try:
                        i, tool, call = todo.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        results[i] = self._one(tool, call, max_chars[i], deadline)
                    except BaseException as exc:  # noqa: BLE001 (re-raised in the calling thread)
                        failures.append(exc)
                        return

            threads = [
                threading.Thread(target=drain, name="enginekit-tools", daemon=True) for _ in range(min(self.concurrency, len(runnable)))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if failures:
                raise failures[0]
        self._check_abandoned()
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Stop every worker process (idempotent); abandoned threads are left to die with the process."""
        if self._finalizer is not None:
            self._finalizer()

    # ------------------------------------------------------------------ internals
    def _one(self, tool: Tool, call: ToolCall, max_chars: int, deadline: float | None) -> ToolResult:
        limit = self.timeout_s
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return ToolResult(call.name, f"Error: tool {call.name!r} was not run: the turn's tool calls ran past their deadline.", True)
            limit = left if limit is None else min(limit, left)
        why = "" if limit == self.timeout_s else " (the turn's deadline for tool calls)"
        if self._pool is not None and tool.spec is not None:
            return self._in_process(tool, call, limit, max_chars, why)
        return self._in_thread(tool, call, limit, max_chars, why)

    def _in_process(self, tool: Tool, call: ToolCall, limit: float | None, max_chars: int, why: str) -> ToolResult:
        request = {"spec": tool.spec, "name": call.name, "args": dict(call.arguments), "max_chars": max_chars}
        out = self._pool.call(request, limit)
        if isinstance(out, Timeout):
            return ToolResult(call.name, f"Error: tool {call.name!r} did not return within {limit:g} s{why}; it was stopped.", True)
        if isinstance(out, Exited):
            return ToolResult(call.name, f"Error: tool {call.name!r} ended its process (exit code {out.code}).", True)
        return ToolResult(call.name, _clean(out["content"]), not out["ok"], bool(out.get("truncated")))

    def _in_thread(self, tool: Tool, call: ToolCall, limit: float | None, max_chars: int, why: str) -> ToolResult:
        box: dict[str, object] = {}

        def target() -> None:
            try:
                box["value"] = content_of(tool.fn(**call.arguments), max_chars)
            except BaseException as exc:  # noqa: BLE001 (user code: judged below)
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"enginekit-tool-{call.name}", daemon=True)
        thread.start()
        thread.join(limit)
        if thread.is_alive():
            with self._abandoned_lock:
                self._abandoned.append((thread, call.name))
            return ToolResult(call.name, f"Error: tool {call.name!r} did not return within {limit:g} s{why}.", True)
        if "error" in box:
            return ToolResult(call.name, f"Error: tool {call.name!r} raised {_describe(box['error'])}", True)
        text, cut = box["value"]  # type: ignore[misc]
        return ToolResult(call.name, _clean(text), False, cut)

    def _check_abandoned(self) -> None:
        with self._abandoned_lock:
            self._abandoned = [(t, name) for t, name in self._abandoned if t.is_alive()]
            alive = list(self._abandoned)
        if len(alive) > self.max_abandoned:
            names = sorted({name for _, name in alive})
            raise RuntimeError(
                f"env.tools: {len(alive)} tool calls that ran past their time are still running in the trainer's threads "
                f"(tools {', '.join(map(repr, names))}), above env.max_abandoned_tools = {self.max_abandoned}: they hold its cores "
                "and can hold Python itself; fix: make the tools return in time, name them by import path in env.tools with "
                "env.tool_isolation=process (a call past its time is then stopped), or raise env.max_abandoned_tools"
            )


def _check(call: ToolCall, registry: Mapping[str, Tool]) -> Tool | ToolResult:
    """The tool to run for ``call``, or the error observation it gets without running."""
    problem = call_problem(call, {name: tool.fn for name, tool in registry.items()})
    return problem if problem is not None else registry[call.name]


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__name__}: {exc}"
    except BaseException:  # noqa: BLE001 (an exception whose str raises)
        return type(exc).__name__


def _clean(text: str) -> str:
    """Text any tokenizer takes: a lone surrogate (e.g. bytes decoded with ``surrogateescape``)
    becomes ``?`` (a tool's output is data, not something to stop the run for)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
