"""One chat turn over a sampler, the part every OpenAI-compatible endpoint of Enginekit shares
(the RL gateway's sessions, ``posttrain.gateway.session``, and the Tinker server's
``/oai/api/v1``, ``tinker_server.routes.openai``): the messages rendered with the model's chat
template, and a sampled answer turned into an OpenAI choice (its ``tool_calls`` parsed from the
sampled text with the run's tool-call format, each with a fresh id; ``content`` the text around
them; the sampled tokens' log-probs as OpenAI's ``logprobs.content``).

Nothing sampled is re-encoded here: the answer's text is what the tokens decode to, and the
tokens themselves are the caller's to keep.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.agents.tools import parse_tool_calls

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def renderer(tokenizer, tools: list[dict] | None, template_kwargs: dict) -> Callable[[list[dict]], str]:
    """``render(messages)``: the chat template's text of ``messages`` with ``tools`` and the
    generation prompt (what the next answer continues)."""

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **template_kwargs)

    return render


@dataclass(frozen=True)
class Answer:
    """A sampled answer as the API returns it.

    Attributes:
        raw: the sampled text (tool-call markup included).
        content: what ``message.content`` says (None for an answer that is only tool calls).
        calls: OpenAI ``tool_calls`` (arguments as a JSON string).
        finish: ``tool_calls``, ``length`` or ``stop``.
    """

    raw: str
    content: str | None
    calls: list[dict[str, Any]]
    finish: str


def answer_of(text: str, hit_length: bool, tool_format: str | None, tools_on: bool) -> Answer:
    """The answer of sampled ``text`` (``hit_length``: it ended at the token limit). Tool calls
    are parsed only when ``tools_on`` (the request declared tools and did not say
    ``tool_choice: none``) and a format is known; a call that does not parse leaves the whole
    text as ``content`` (the agent sees what the model wrote)."""
    calls: list[dict[str, Any]] = []
    if tool_format and tools_on:
        parsed = parse_tool_calls(text, tool_format)
        if parsed and all(c.error is None for c in parsed):
            calls = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))},
                }
                for c in parsed
            ]
    content = without_calls(text, tool_format) if calls else text
    finish = "tool_calls" if calls else ("length" if hit_length else "stop")
    return Answer(text, content if content else (None if calls else ""), calls, finish)


def without_calls(text: str, fmt: str | None) -> str:
    """An answer's text without its tool-call markup (what the agent sees as ``content``)."""
    if fmt == "hermes":
        out, rest = [], text
        while _HERMES_OPEN in rest and _HERMES_CLOSE in rest.split(_HERMES_OPEN, 1)[1]:
            before, after = rest.split(_HERMES_OPEN, 1)
            out.append(before)
            rest = after.split(_HERMES_CLOSE, 1)[1]
        return ("".join(out) + rest).strip()
    return ""  # llama3: the whole turn is the call(s)


def token_logprobs(tokenizer, ids: Sequence[int], log_probs: Sequence[float]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per sampled token its text, log-prob and bytes
    (``top_logprobs`` empty: a sampler returns the sampled tokens' log-probs only)."""
    out = []
    for i, lp in zip(ids, log_probs, strict=True):
        piece = tokenizer.decode([int(i)], skip_special_tokens=False)
        out.append({"token": piece, "logprob": float(lp), "bytes": list(piece.encode("utf-8", "replace")), "top_logprobs": []})
    return out
