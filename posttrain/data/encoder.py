"""Rows as token ids (``ChatEncoder``): SFT samples with their loss masks, RL prompts rendered
with the generation prompt, through the model's tokenizer and chat template.

SFT rows (``data.format``):
    * ``messages``: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant",
      "content": ...}, ...]}``. Rendered with the chat template and tokenized in one call (HF's
      own ``apply_chat_template(tokenize=True)`` ids); the loss covers each assistant turn
      (``data.loss_on``): the text the template adds for it after the generation prompt (the
      content, the end-of-turn marker and what the template writes after it), nothing of the
      system/user turns or of the generation prompt itself.
    * ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
      "value": ...}, ...]}``, turned into messages (``posttrain.data.messages``) and then read as
      ``messages`` rows (identical ids and loss masks).
    * ``prompt_response``: ``{"prompt": ..., "response": ...}``. With ``data.apply_chat_template``
      it is the conversation ``[user: prompt, assistant: response]`` (as above); without, the
      raw text ``prompt`` (with the tokenizer's special tokens, e.g. BOS) then ``response`` and
      EOS, the loss on ``response`` + EOS.
RL rows: ``data.prompt_key`` holds a string (wrapped as one user turn when
``data.apply_chat_template``), a list of chat messages, or a list of ShareGPT turns (converted as
above); it is rendered with the generation prompt. Every other column travels with the row to
the reward function.

A chat template that renders an earlier turn differently once later turns follow (e.g. one that
drops past reasoning) cannot give that turn a loss mask: the row is refused, naming the fix
(``data.loss_on=last_turn``).
"""

from __future__ import annotations

from posttrain.data.config import DataConfig
from posttrain.data.messages import check_messages, is_sharegpt, sharegpt_to_messages


class ChatEncoder:
    """Turns rows into token ids with one tokenizer and the recipe's ``data`` settings."""

    def __init__(self, tokenizer, cfg: DataConfig) -> None:
        self.tok, self.cfg = tokenizer, cfg

    def _render(self, messages: list, add_generation_prompt: bool, source: str) -> str:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"row {source}: needs the tokenizer's chat template, but the tokenizer has none; fix: save a chat template with "
                "the tokenizer, or (string prompts only) set data.apply_chat_template=false"
            )
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **dict(self.cfg.chat_template_kwargs)
            )
        except Exception as exc:  # noqa: BLE001 (jinja raises anything; the row must be named)
            raise ValueError(f"row {source}: the chat template failed on it: {exc}; fix: check the row's messages") from exc

    def _ids(self, text: str, special: bool = False) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"]) if text else []

    def conversation(self, messages: object, source: str) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a chat rendered once with the template; the mask is 1 on the
        tokens of what the template adds for each trained assistant turn after its generation
        prompt (``data.loss_on``: every assistant turn, or the last one only).

        A turn's text span runs from the end of ``render(messages[:i], add_generation_prompt)``
        to the end of ``render(messages[:i + 1])``; both must be prefixes of the full rendering.
        The full text is tokenized in one call, and a token is trained when its character span
        overlaps a trained turn's span (tokenizers without offsets: each piece separately)."""
        messages = check_messages(messages, source)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise ValueError(f"row {source}: no assistant turn, so nothing to learn; fix: add one or drop the row")
        if self.cfg.loss_on == "last_turn":
            turns = turns[-1:]
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and m.get("content") is None:
                self._require_rendered_tool_calls(messages, i, source)
        full = self._render(messages, False, source)
        spans: list[tuple[int, int]] = []
        for i in turns:
            start = self._render(messages[:i], True, source) if i else ""
            end = self._render(messages[: i + 1], False, source)
            if not (
                full.startswith(start) and full.startswith(end) and len(start) <= len(end) and (not spans or spans[-1][1] <= len(start))
            ):
                raise ValueError(
                    f"row {source}: the chat template renders the conversation up to message {i} differently once later messages "
                    "follow (e.g. it drops the reasoning of past turns), so that turn's tokens cannot be told apart; fix: "
                    "data.loss_on=last_turn (earlier turns become context), or one row per assistant turn"
                )
            spans.append((len(start), len(end)))
        return self._tokenize_spans(full, spans)

    def _require_rendered_tool_calls(self, messages: list[dict], i: int, source: str) -> None:
        """An assistant turn with ``content: null`` and ``tool_calls`` is only its calls: the
        template must render them. One that ignores ``tool_calls`` writes the content instead
        (Jinja prints null as ``None``) and drops the call, so the turn would be trained as
        the word None; refused, naming the row."""
        start = self._render(messages[:i], True, source) if i else ""
        text = self._render(messages[: i + 1], False, source)[len(start) :]
        names = [
            str(call.get("function", {}).get("name") or call.get("name") or "")
            for call in messages[i]["tool_calls"]
            if isinstance(call, dict)
        ]
        names = [n for n in names if n]
        if (names and all(n in text for n in names)) or (not names and "None" not in text):
            return
        raise ValueError(
            f"row {source}: message {i} (assistant) has content null and tool_calls {names or messages[i]['tool_calls']}, but the "
            f"chat template does not render tool calls (that turn renders as {text[:80]!r}): the call would be dropped and "
            "the turn trained as the word None; fix: a chat template that renders tool_calls (usually the model's own), "
            "or give the call as the message's text content"
        )

    def _tokenize_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            enc = None  # a tokenizer without offsets (slow, Python-only): tokenize piece by piece
        if enc is not None and "offset_mapping" in enc:
            ids = list(enc["input_ids"])

            def trained(s: int, e: int) -> bool:
                return any((s < b and e > a) if e > s else a <= s < b for a, b in spans)

            mask = [int(trained(s, e)) for s, e in enc["offset_mapping"]]
        else:
            ids, mask, cursor = [], [], 0
            for a, b in spans:
                for piece, train in ((text[cursor:a], 0), (text[a:b], 1)):
                    new = self._ids(piece)
                    ids.extend(new)
                    mask.extend([train] * len(new))
                cursor = b
            tail = self._ids(text[cursor:])
            ids.extend(tail)
            mask.extend([0] * len(tail))
        if mask:
            mask[0] = 0  # nothing predicts the first token
        return ids, mask

    def prompt_response(self, prompt: object, response: object, source: str) -> tuple[list[int], list[int]]:
        """``(ids, loss_mask)`` of a prompt/response pair (the loss on the response)."""
        for name, value in (("prompt_key", prompt), ("response_key", response)):
            if not isinstance(value, str):
                raise ValueError(f"row {source}: data.{name} column holds a {type(value).__name__}, not text; fix: a string column")
        if self.cfg.apply_chat_template:
            return self.conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], source)
        if self.tok.eos_token_id is None:
            raise ValueError(f"row {source}: the tokenizer has no EOS token to end the response; fix: set eos_token in its config")
        head, tail = self._ids(prompt, special=True), self._ids(response) + [int(self.tok.eos_token_id)]
        return head + tail, [0] * len(head) + [1] * len(tail)

    def prompt(self, value: object, source: str) -> tuple[list[int], str]:
        """``(ids, text)`` of an RL prompt rendered with the generation prompt."""
        messages = self.prompt_messages(value, source)
        if messages is None:
            return self._ids(value, special=True), value
        text = self._render(messages, True, source)
        return self._ids(text), text

    def prompt_messages(self, value: object, source: str) -> list[dict] | None:
        """An RL prompt column's value as checked chat messages (a string is one user turn);
        None for a string prompt with ``apply_chat_template`` off (raw text)."""
        if isinstance(value, str):
            if not self.cfg.apply_chat_template:
                return None
            value = [{"role": "user", "content": value}]
        elif is_sharegpt(value):
            value = sharegpt_to_messages(value, source)
        value = check_messages(value, source)
        for i, m in enumerate(value):
            if m["role"] == "assistant" and m.get("content") is None:
                self._require_rendered_tool_calls(value, i, source)
        return value
