"""The OpenAI chat-completions wire format the gateway speaks: a request checked into a
:class:`ChatRequest`, and the answers (a completion, its stream, an error) as the OpenAI SDK
reads them.

Accepted: ``messages`` (``system`` / ``developer`` / ``user`` / ``assistant`` / ``tool``;
content a string, or a list of ``{"type": "text"}`` parts), ``tools`` (function tools),
``tool_choice`` (``auto`` or ``none``), ``n`` (up to the endpoint's limit: 1 on the RL gateway,
where a session is one trajectory and GRPO's groups are the ``algo.n_samples`` sessions of a row),
``temperature`` / ``top_p`` (see
``agent.request_sampling``), ``max_tokens`` / ``max_completion_tokens`` (capped by the run's
``rollout.max_new_tokens`` and the session's token budget), ``logprobs`` (``top_logprobs`` gets
empty lists: the rollout returns the sampled tokens' log-probs only), ``stop`` (a string or up to
four), ``seed`` (mixed into the session's seed), ``stream`` (the whole answer as one chunk, then
``[DONE]``). Other fields the SDKs send (``user``, ``metadata``, ``store``,
``parallel_tool_calls``, ...) are accepted and ignored. What is refused gets an OpenAI-style
error (:class:`WireError`): the field, the value, the fix.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


class WireError(Exception):
    """A request the gateway answers with an OpenAI-style error.

    Args:
        message: what is wrong, naming the field, the value and the fix.
        status: the HTTP status (400, 404, 409, 413, 429, 500).
        param: the request field at fault, if one.
        code: OpenAI's error code (``context_length_exceeded``, ...), if one.
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request (module docstring)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    n: int = 1


def parse_request(body: object, max_n: int = 1) -> ChatRequest:
    """``body`` (the decoded JSON) as a :class:`ChatRequest`; ``max_n``: the most choices one
    request may ask for.

    Raises:
        WireError: a field of the wrong type or value (400), naming it.
    """
    if not isinstance(body, Mapping):
        raise WireError(f"the body is a JSON {type(body).__name__}; fix: a JSON object with 'messages'")
    messages = [_message(m, i) for i, m in enumerate(_list(body, "messages", required=True))]
    if not messages:
        raise WireError("messages = []: a chat completion needs at least one message", param="messages")
    tools = [_tool(t, i) for i, t in enumerate(_list(body, "tools"))]
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise WireError(
            f"tool_choice = {choice!r}: the gateway samples the policy as it is and cannot force a call; fix: 'auto' or 'none'",
            param="tool_choice",
        )
    n = body.get("n", 1)
    if n is None:
        n = 1
    if max_n == 1 and n != 1:
        raise WireError(
            f"n = {n!r}: a session is one trajectory, so one choice; fix: n=1 (GRPO's group is the algo.n_samples sessions of a row)",
            param="n",
        )
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n:
        raise WireError(f"n = {n!r}: must be an integer in [1, {max_n}]", param="n")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise WireError(f"stop = {stop!r}: up to 4 non-empty strings; fix: a string or a list of them", param="stop")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice or "auto",
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        top_k=_integer(body, "top_k", -1),
        max_tokens=None if limit is None else _integer({"max_tokens": limit}, "max_tokens", 1),
        logprobs=bool(body.get("logprobs") or False),
        top_logprobs=_integer(body, "top_logprobs", 0) or 0,
        stop=stops,
        seed=_integer(body, "seed", -(2**63)),
        stream=bool(body.get("stream") or False),
        include_usage=bool(isinstance(options, Mapping) and options.get("include_usage")),
        model=str(body.get("model") or ""),
        n=n,
    )


def _list(body: Mapping, key: str, required: bool = False) -> list:
    value = body.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list):
        raise WireError(f"{key} = {str(value)[:60]!r}: must be a list; fix: a JSON array", param=key)
    return value


def _number(body: Mapping, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise WireError(f"{key} = {value!r}: must be a number in [{low:g}, {high:g}]", param=key)
    return float(value)


def _integer(body: Mapping, key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise WireError(f"{key} = {value!r}: must be an integer >= {low}", param=key)
    return value


def text_of(content: object, where: str) -> str:
    """A message's content as text: a string, or the concatenation of ``text`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text") or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise WireError(f"{where}.content: a part of type {kind!r}; fix: text parts only (the policy reads text)", param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise WireError(f"{where}.content is a {type(content).__name__}; fix: a string or a list of text parts", param=where)


def _message(m: object, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping) or m.get("role") not in ROLES:
        role = m.get("role") if isinstance(m, Mapping) else None
        raise WireError(f"{where}.role = {role!r}: unknown; fix: one of {', '.join(ROLES)}", param=where)
    out: dict[str, Any] = {"role": m["role"], "content": text_of(m.get("content"), where)}
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise WireError(f"{where}: a tool message without a tool_call_id; fix: the id of the call it answers", param=where)
        out["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    calls = m.get("tool_calls")
    if m["role"] == "assistant" and calls:
        if not isinstance(calls, list):
            raise WireError(f"{where}.tool_calls must be a list", param=where)
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    return out


def _tool_call(c: object, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise WireError(f"{where}: not a function call with a name", param=where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise WireError(f"{where}.function.arguments is not JSON ({exc.msg})", param=where) from None
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tool(t: object, i: int) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, Mapping) else None
    if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping) or not fn.get("name"):
        raise WireError(
            f"tools[{i}]: not a function tool with a name; fix: {{'type': 'function', 'function': {{'name': ...}}}}", param="tools"
        )
    return {"type": "function", "function": dict(fn)}


# ---------------------------------------------------------------------------------- answers
def choice(
    index: int, content: str | None, tool_calls: Sequence[dict[str, Any]], finish_reason: str, logprobs: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """One ``choices`` entry of a ``chat.completion``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = list(tool_calls)
    return {
        "index": index,
        "message": message,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }


def completion(model: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A ``chat.completion`` object (``choices`` from :func:`choice`)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def stream_chunks(answer: dict[str, Any], include_usage: bool) -> list[str]:
    """The server-sent events of ``answer`` streamed: per choice its whole message as one delta,
    then its finish reason; the usage when asked; then ``[DONE]``."""
    head = {k: answer[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events = []
    for c in answer["choices"]:
        delta: dict[str, Any] = {"role": "assistant", "content": c["message"]["content"]}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [{**call, "index": k} for k, call in enumerate(c["message"]["tool_calls"])]
        events.append({**head, "choices": [{"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}]})
        events.append({**head, "choices": [{"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}]})
    if include_usage:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def models(*names: str) -> dict[str, Any]:
    """``/v1/models``."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "enginekit"} for name in names]}
