"""Running the user's agents (``agent.function``): each session's ``run(base_url, **row)`` in a
worker process (``posttrain.gateway.agent_worker``), at most ``agent.max_concurrency`` at once,
each bounded by ``agent.timeout_s`` (its process group killed past it).

Nothing an agent does stops the run: raising, exiting the process, hanging, holding the GIL or
returning something that is not a reward are each an :class:`Outcome` of kind ``failed`` or
``timeout``, counted in the step's metrics. The workers' stderr (what the agents print) goes to
the run's log file (``<trainer.output_dir>/agent_logs/agents.log``).
"""

from __future__ import annotations

import json
import numbers
import os
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from posttrain.workers import Exited, Timeout, WorkerPool


@dataclass(frozen=True)
class Outcome:
    """How a session's agent ended.

    Attributes:
        kind: ``reward`` (it returned a number), ``answer`` (a string for ``reward.function``),
            ``none`` (``reward.function`` scores the last assistant message), ``failed`` or
            ``timeout``.
        value: the reward or the answer.
        error: why it failed.
    """

    kind: str
    value: float | str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind in ("reward", "answer", "none")


class AgentRunner:
    """The agents of a run (module docstring).

    Args:
        spec: ``agent.function``.
        concurrency: ``agent.max_concurrency``.
        timeout_s: ``agent.timeout_s``.
        log_dir: where the workers' stderr goes (``agents.log``); None: this process's stderr.
    """

    def __init__(self, spec: str, concurrency: int, timeout_s: float, log_dir: str | None) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        self._log = None
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            self._log = open(os.path.join(log_dir, "agents.log"), "ab")  # noqa: SIM115 (open for the run's life)
            self.log_path = os.path.join(log_dir, "agents.log")
        else:
            self.log_path = "<stderr>"
        self.pool = WorkerPool("posttrain.gateway.agent_worker", stderr=self._log, name="agent")
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._drain, name=f"enginekit-agent-{k}", daemon=True) for k in range(concurrency)]
        for t in self._threads:
            t.start()

    def submit(self, base_url: str, row: Mapping[str, Any], done: Callable[[Outcome], None]) -> None:
        """Run the agent for one session; ``done(outcome)`` is called once, from a runner thread."""
        self._queue.put((base_url, jsonable(row), done))

    def close(self) -> None:
        """Stop every agent process (idempotent); queued sessions are not started."""
        for _ in self._threads:
            self._queue.put(None)
        self.pool.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            base_url, row, done = job
            try:
                out = self.pool.call({"spec": self.spec, "base_url": base_url, "row": row}, self.timeout_s)
            except RuntimeError as exc:  # the pool closed under it: the run is ending
                done(Outcome("failed", error=str(exc)))
                continue
            if isinstance(out, Timeout):
                done(Outcome("timeout", error=f"did not return within agent.timeout_s = {self.timeout_s:g} s; its process was killed"))
            elif isinstance(out, Exited):
                done(Outcome("failed", error=f"its process exited (status {out.code}) before returning"))
            elif not out.get("ok"):
                done(Outcome("failed", error=str(out.get("error"))))
            else:
                done(Outcome(out["kind"], out.get("value")))


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot hold made plain: NumPy scalars and arrays (``tolist``),
    tuples as lists, bytes as text, anything else by ``str``."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    if isinstance(value, numbers.Number):
        return float(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)
