"""Chat messages as rows hold them: ShareGPT turns turned into messages, and every message's
content checked to be text.

Message content (SFT ``messages`` rows, RL prompts given as messages) must be text: a string, or
a list of text parts (``[{"type": "text", "text": ...}, ...]``, OpenAI style; joined with
newlines, as vLLM joins them). ``null`` (except for an assistant message with ``tool_calls``),
numbers, mappings and non-text parts are refused, naming the row, the message and its role.

ShareGPT speakers (``from``, case-insensitive): ``human`` / ``user`` -> user, ``gpt`` /
``assistant`` / ``bot`` / ``chatgpt`` / ``model`` -> assistant, ``system`` -> system. Tool turns
(``tool``, ``function``, ``observation``, ``function_call``) and any other speaker are refused,
naming the row, the turn and the value: templates render tool calls and results each their own
way, so they have no one mapping (give such rows as ``messages`` with ``tool`` messages and
``tool_calls``). A turn with a ``weight`` other than 1 is refused too (per-turn loss weights are
not read; ``data.loss_on`` picks the trained turns).
"""

from __future__ import annotations

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
SHAREGPT_TOOL_TURNS = ("tool", "function", "observation", "function_call")


def sharegpt_to_messages(turns: object, source: str) -> list[dict]:
    """ShareGPT turns (``[{"from": "human", "value": ...}, ...]``) as chat messages
    (``[{"role": "user", "content": ...}, ...]``; the speakers of ``SHAREGPT_ROLES``,
    case-insensitive). A turn without ``value`` becomes a message without content, which
    ``check_messages`` refuses like any other.

    Raises:
        ValueError: not a non-empty list of turns with a string ``from``, a tool turn or an
            unknown speaker, or a turn with a ``weight`` other than 1; naming the row and the turn.
    """
    ok = isinstance(turns, list) and turns and all(isinstance(t, dict) and isinstance(t.get("from"), str) for t in turns)
    if not ok:
        raise ValueError(
            f"row {source}: expected a non-empty list of ShareGPT turns ({{'from': ..., 'value': ...}}), got {str(turns)[:80]!r}; "
            "fix: check data.messages_key / data.prompt_key and data.format"
        )
    out = []
    for i, turn in enumerate(turns):
        who = turn["from"]
        role = SHAREGPT_ROLES.get(who.strip().lower())
        where = f"row {source}: turn {i} has from = {who!r}"
        if who.strip().lower() in SHAREGPT_TOOL_TURNS:
            raise ValueError(
                f"{where}, a tool turn: tool calls and results have no one mapping to chat messages (each template renders them its "
                "own way); fix: give such rows as data.format=messages with role 'tool' messages and assistant tool_calls, or drop "
                "those turns"
            )
        if role is None:
            raise ValueError(
                f"{where}, not a known speaker ({', '.join(SHAREGPT_ROLES)}); fix: rename it to one of these (human, gpt, system), "
                "or convert the row to data.format=messages"
            )
        if turn.get("weight", 1) not in (1, None):
            raise ValueError(
                f"{where} and weight = {turn['weight']!r}: per-turn loss weights are not read (data.loss_on picks the trained "
                "assistant turns), so it would be trained anyway; fix: drop the weight key, or split the row so no turn needs it"
            )
        out.append({"role": role, "content": turn["value"]} if "value" in turn else {"role": role})
    return out


def is_sharegpt(value: object) -> bool:
    """A list of ShareGPT turns (dicts with ``from`` and no ``role``)."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, dict) and "from" in t and "role" not in t for t in value)


def check_messages(messages: object, source: str) -> list[dict]:
    """``messages`` with every ``content`` as text: a list of text parts (OpenAI style
    ``[{"type": "text", "text": ...}]``) is joined with newlines (as vLLM joins them).

    Raises:
        ValueError: not a non-empty list of ``{"role": str, ...}`` messages, or a message whose
            content is missing, null (allowed only for an assistant message with ``tool_calls``),
            a number, a mapping or a list with non-text parts; naming the row, the message index
            and its role.
    """
    ok = isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        hint = " (ShareGPT turns are read with data.format=sharegpt)" if is_sharegpt(messages) else ""
        raise ValueError(
            f"row {source}: expected a non-empty list of chat messages ({{'role': ..., 'content': ...}}), got {str(messages)[:80]!r}; "
            f"fix: check data.messages_key / data.prompt_key{hint}"
        )
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            out.append(m)
            continue
        where = f"row {source}: message {i} ({m['role']})"
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            out.append(m)  # a tool-call turn: the template renders the calls
            continue
        if content is None:
            raise ValueError(
                f"{where} has {'content null' if 'content' in m else 'no content'}; an empty reply would be trained or shown "
                "silently; fix: give the message's text (an empty string if it is meant to be empty), or drop the message"
            )
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if content and len(texts) == len(content) and all(isinstance(t, str) for t in texts):
                out.append({**m, "content": "\n".join(texts)})
                continue
            kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
            raise ValueError(
                f"{where}: its content is a list of parts of type(s) {kinds}; only text parts ({{'type': 'text', 'text': ...}}) "
                "are read (these recipes train on text); fix: give the content as a string, or as text parts only"
            )
        raise ValueError(
            f"{where}: content is a {type(content).__name__} ({str(content)[:40]}), not text; it would be rendered as its "
            "Python text; fix: give the content as a string"
        )
    return out
