"""An agent worker process: runs ``agent.function`` for one session at a time, for
``posttrain.gateway.agents``.

Started as ``python -m posttrain.gateway.agent_worker`` in a process group of its own. It reads
one JSON request per line on stdin (``{"spec": "pkg.mod:run", "base_url": ..., "row": {...}}``),
loads the agent by its import path (``posttrain.fencing.load_callable``; cached), calls
``run(base_url, **row)`` (an ``async`` one under ``asyncio.run``) and writes one JSON answer per
line on its protocol pipe: ``{"ok": true, "kind": "reward" | "answer" | "none", "value": ...}``
or ``{"ok": false, "error": ...}``. The agent's prints go to stderr (file descriptor 1 is pointed
there; the run keeps the workers' stderr in its logs). The parent enforces the session's time
limit by killing the process group; SIGINT is ignored (the trainer's to handle); on Linux it
dies with its parent.

Imports only the standard library and ``posttrain.fencing`` (no torch): an agent's own imports
(the ``openai`` SDK, a framework) are paid once per worker.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers


def classify(value: object) -> dict:
    """The answer for an agent's return value: a finite real number is a reward, a string the
    final answer, None leaves the scoring to ``reward.function``; anything else is a failure."""
    if value is None:
        return {"ok": True, "kind": "none", "value": None}
    if isinstance(value, str):
        return {"ok": True, "kind": "answer", "value": value}
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        if math.isfinite(float(value)):
            return {"ok": True, "kind": "reward", "value": float(value)}
        return {"ok": False, "error": f"returned the reward {float(value)}, not a finite number"}
    return {"ok": False, "error": f"returned a {type(value).__name__} ({str(value)[:60]!r}); a reward (number), the answer (str) or None"}


def answer(request: dict, cache: dict) -> dict:
    """Run the agent of ``request`` (module docstring); never raises for the agent's doing."""
    from posttrain.fencing import load_callable

    spec = request["spec"]
    try:
        fn = cache.get(spec)
        if fn is None:
            fn = cache[spec] = load_callable(spec, "agent.function")
    except ValueError as exc:
        return {"ok": False, "error": f"could not be loaded: {exc}"}
    try:
        out = fn(request["base_url"], **request["row"])
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
    except BaseException as exc:  # noqa: BLE001 (user code: SystemExit and all are failures it reports)
        try:
            detail = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001
            detail = type(exc).__name__
        return {"ok": False, "error": f"raised {detail}"}
    return classify(out)


async def _awaited(awaitable):
    return await awaitable


def main() -> None:
    from posttrain.workers import serve

    serve(answer)


if __name__ == "__main__":
    main()
