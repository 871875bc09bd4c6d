"""Tools for multi-turn RL: declared with OpenAI-style JSON schemas, parsed out of an assistant
turn in the model family's tool-call format, and executed fenced like reward functions.

* **Declaring.** A tool is a Python callable. Its schema (what the chat template shows the
  model) is, in this order: the callable's ``schema`` attribute (an OpenAI ``{"type":
  "function", "function": {...}}`` dict or its inner ``function`` part), the row's ``tools``
  column entry of the same name, or transformers' ``get_json_schema`` of its type hints and
  Google-style docstring. A ``tools`` column entry with no callable of its name is shown to the
  model, and a call to it is answered with an error observation.
* **Parsing** (:func:`parse_tool_calls`). ``hermes`` (Qwen2.5 / Qwen3 / Hermes / many others):
  each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. ``llama3``
  (Llama 3.1 / 3.2 JSON tool calling): the whole turn, after an optional ``<|python_tag|>``,
  is one JSON object ``{"name": ..., "parameters": {...}}`` (or several joined by ``;``); a
  turn that does not start with ``{`` is a plain answer. A call whose JSON does not parse, or
  lacks a string ``name`` or object arguments, is a malformed call: reported, never executed.
* **Executing**: a turn's calls run concurrently in ``posttrain.agents.tool_runner`` (worker
  processes, each call bounded and stopped past ``env.tool_timeout_s``); :func:`run_tool` runs
  one call in a daemon thread of this process (abandoned on timeout, as ``posttrain.fencing``
  does: a thread cannot be killed). Anything a tool raises, ``sys.exit`` included, becomes an
  error observation naming the tool; so does a result whose ``str`` raises. The result is
  ``str(value)`` (a dict or list as JSON). An unknown tool, bad arguments (``TypeError`` on the
  call) and a timeout are error observations too: the model sees them and the run counts them
  (``env/tool_errors_sum``).
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.fencing import FencedTimeout, fenced

TOOL_FORMATS = ("auto", "hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments``; ``error`` (not None) says why the call is
    malformed (then ``name`` may be empty and nothing is executed); ``raw`` is its text."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches (``auto``): ``hermes`` when it mentions
    ``<tool_call>``, ``llama3`` when it mentions ``<|python_tag|>`` or the ``ipython`` role;
    None when neither (set ``env.tool_format``)."""
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if _PYTHON_TAG in text or "ipython" in text:
        return "llama3"
    return None


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall]:
    """The tool calls of one assistant turn's text in format ``fmt`` (module docstring);
    malformed ones carry their ``error``."""
    if fmt == "hermes":
        calls = [_call_from_json(m.group(1), "arguments", m.group(0)) for m in _HERMES.finditer(text)]
        tail = _HERMES.sub("", text)
        if "<tool_call>" in tail:
            start = tail.index("<tool_call>")
            calls.append(ToolCall("", raw=tail[start:], error="a <tool_call> without its closing </tool_call>"))
        return calls
    if fmt == "llama3":
        body = text.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :].strip()
        if not body.startswith("{"):
            return []
        return _llama3_calls(body)
    raise ValueError(f"tool format {fmt!r}: unknown; fix: one of {', '.join(TOOL_FORMATS[1:])}")


def _llama3_calls(body: str) -> list[ToolCall]:
    """Llama 3.1's JSON calls: one object, or several joined by ``;``. Each object is read with a
    JSON decoder, so a ``;`` inside a string argument is part of the argument, never a split."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        start = pos
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            piece = body[start:].split(";", 1)[0] if "{" not in body[start + 1 :] else body[start:]
            calls.append(ToolCall("", raw=piece, error=f"the call is not valid JSON ({exc.msg} at character {exc.pos - start})"))
            return calls
        calls.append(_call_from_obj(obj, "parameters", body[start:end]))
        pos = end
        while pos < len(body) and body[pos].isspace():
            pos += 1
        if pos < len(body):
            if body[pos] != ";":
                calls.append(
                    ToolCall("", raw=body[pos:], error=f"text after a call that is not ';' and another call: {body[pos : pos + 20]!r}")
                )
                return calls
            pos += 1
            while pos < len(body) and body[pos].isspace():
                pos += 1
    return calls


def _call_from_json(body: str, key: str, raw: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCall("", raw=raw, error=f"the call is not valid JSON ({exc.msg} at character {exc.pos})")
    return _call_from_obj(obj, key, raw)


def _call_from_obj(obj: object, key: str, raw: str) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", raw=raw, error=f"the call is a JSON {type(obj).__name__}, not an object with 'name' and '{key}'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", raw=raw, error="the call has no string 'name'")
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name, raw=raw, error=f"the arguments of {name!r} are a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(name, raw=raw, error=f"the arguments of {name!r} are a JSON {type(args).__name__}, not an object")
    return ToolCall(name, args, raw)


def tool_schema(fn: Callable[..., Any], declared: Mapping[str, Mapping] | None = None) -> dict:
    """The OpenAI-style schema of tool ``fn`` (module docstring's order).

    Raises:
        ValueError: no schema could be built (naming the tool and the fix).
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    own = getattr(fn, "schema", None)
    if isinstance(own, Mapping):
        return dict(own) if "function" in own else {"type": "function", "function": dict(own)}
    if declared and name in declared:
        return dict(declared[name])
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # noqa: BLE001 (transformers raises its own errors for undocumented arguments)
        raise ValueError(
            f"tool {name!r}: no schema ({exc}); fix: give it type hints and a Google-style docstring with an Args section, a "
            "'schema' attribute, or declare it in the row's tools column"
        ) from exc


def schema_name(schema: Mapping) -> str:
    """The tool name an OpenAI-style schema declares ('' when it declares none)."""
    inner = schema.get("function", schema)
    return str(inner.get("name", "")) if isinstance(inner, Mapping) else ""


def check_declared_tools(value: object, source: str) -> list[dict]:
    """A row's ``tools`` column as a list of schemas (None: none).

    Raises:
        ValueError: not a list of objects each naming a function (naming the row)."""
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"row {source}: the tools column is a string that is not JSON ({exc.msg}); fix: a list of schemas") from exc
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"row {source}: the tools column holds a {type(value).__name__}; fix: a list of OpenAI-style tool schemas")
    out = []
    for i, entry in enumerate(value):
        if not isinstance(entry, Mapping) or not schema_name(entry):
            raise ValueError(
                f"row {source}: tools[{i}] is not a tool schema naming a function; fix: "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
            )
        out.append(dict(entry) if "function" in entry else {"type": "function", "function": dict(entry)})
    return out


@dataclass(frozen=True)
class ToolResult:
    """What one call returned to the model: ``content`` (the observation text), ``error``
    (True for an error observation: malformed call, unknown tool, bad arguments, raised,
    timed out), ``truncated`` (the result was cut to the observation bound)."""

    name: str
    content: str
    error: bool
    truncated: bool = False


def call_problem(call: ToolCall, registry: Mapping[str, Callable[..., Any]]) -> ToolResult | None:
    """The error observation ``call`` gets without running (malformed, an unknown tool, arguments
    its callable does not take), or None when it can run."""
    if call.error is not None:
        return ToolResult(call.name, f"Error: malformed tool call: {call.error}.", True)
    fn = registry.get(call.name)
    if fn is None:
        known = ", ".join(sorted(registry)) or "none"
        return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available tools: {known}.", True)
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolResult(call.name, f"Error: bad arguments for {call.name!r}: {exc}.", True)
    except ValueError:
        pass  # not introspectable: the call itself will say
    return None


def run_tool(
    call: ToolCall, registry: Mapping[str, Callable[..., Any]], timeout_s: float | None, max_chars: int | None = None
) -> ToolResult:
    """Execute ``call`` with ``registry``'s callable of its name in a daemon thread of this
    process, fenced (module docstring); the result cut to ``max_chars`` characters (None: whole).
    The loop runs a turn's calls through ``posttrain.agents.tool_runner`` instead (stoppable)."""
    from posttrain.agents.tool_worker import content_of

    problem = call_problem(call, registry)
    if problem is not None:
        return problem
    fn = registry[call.name]
    limit = max_chars if max_chars is not None else 1 << 62
    try:
        text, cut = fenced(lambda: content_of(fn(**call.arguments), limit), timeout_s)
    except KeyboardInterrupt:
        raise
    except FencedTimeout:
        return ToolResult(call.name, f"Error: tool {call.name!r} did not return within {timeout_s:g} s.", True)
    except BaseException as exc:  # noqa: BLE001 (the tool is user code: sys.exit and all become an observation)
        try:
            detail = f"{type(exc).__name__}: {exc}"
        except BaseException:  # noqa: BLE001 (an exception whose str raises)
            detail = type(exc).__name__
        return ToolResult(call.name, f"Error: tool {call.name!r} raised {detail}", True)
    return ToolResult(call.name, text, False, cut)
