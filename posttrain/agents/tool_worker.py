"""A tool worker process: runs tool calls one at a time for ``posttrain.agents.tool_runner``.

Started as ``python -m posttrain.agents.tool_worker`` in a session of its own. It reads one JSON
request per line on stdin (``{"spec": "pkg.mod:fn", "args": {...}, "max_chars": N}``), loads the
tool by its import path (``posttrain.fencing.load_callable``; cached), calls it, and writes one
JSON answer per line (``{"ok": bool, "content": str, "truncated": bool}``) on its protocol pipe.
Anything the tool prints goes to stderr (file descriptor 1 is pointed there, so a ``print`` in
a tool, or C code writing to stdout, cannot corrupt the protocol).

The parent enforces every time limit by killing the worker's process group; the worker itself
has none. It exits when its stdin closes, and (Linux) when the thread that started it exits
(``PR_SET_PDEATHSIG``), so a killed trainer leaves no tool running. SIGINT is ignored: a Ctrl-C
in the terminal is the trainer's to handle, which then stops its workers.

Imports only the standard library, ``posttrain.fencing`` and ``posttrain.workers`` (its loop,
``serve``; no torch), so it starts in tens of
milliseconds; a tool's own imports are paid once per worker.
"""

from __future__ import annotations

import json


def content_of(value: object, max_chars: int) -> tuple[str, bool]:
    """A tool's return value as the observation text (a dict or list as JSON, else ``str``),
    cut to ``max_chars`` characters; whether it was cut. Raises what ``str`` raises."""
    text = None
    if isinstance(value, (dict, list)):
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = None
    if text is None:
        text = str(value)
    if not isinstance(text, str):  # a __str__ returning a non-str raises in str() already; belt and braces
        raise TypeError(f"str() of the result gave a {type(text).__name__}")
    return (text[:max_chars], True) if len(text) > max_chars else (text, False)


def answer(request: dict, cache: dict) -> dict:
    """The answer to one request (module docstring); never raises for the tool's doing."""
    from posttrain.fencing import load_callable

    spec, name = request["spec"], request.get("name", request["spec"])
    try:
        fn = cache.get(spec)
        if fn is None:
            fn = cache[spec] = load_callable(spec, "env.tools")
    except ValueError as exc:
        return {"ok": False, "content": f"Error: tool {name!r} could not be loaded: {exc}", "truncated": False}
    try:
        value = fn(**request["args"])
        text, cut = content_of(value, int(request["max_chars"]))
    except BaseException as exc:  # noqa: BLE001 (the tool is user code: sys.exit and all become an observation)
        try:
            detail = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 (an exception whose str raises)
            detail = type(exc).__name__
        return {"ok": False, "content": f"Error: tool {name!r} raised {detail}", "truncated": False}
    return {"ok": True, "content": text, "truncated": cut}


def main() -> None:
    from posttrain.workers import serve

    serve(answer)


if __name__ == "__main__":
    main()
