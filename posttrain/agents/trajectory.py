"""A multi-turn trajectory kept token in, token out.

The model's own tokens are kept exactly as the rollout engine sampled them (ids, log-probs,
weight versions) and are never decoded and re-encoded. What the environment returns enters as
the suffix of the chat template rendered over the whole conversation:

1. the conversation's messages are the prompt's, then each assistant turn as the raw text of
   its sampled tokens (tool-call markup included; the end-of-turn stop token left to the
   template, which writes it), then the observations;
2. the kept text is the text the kept tokens stand for: the rendered prompt, each model turn's
   decoded tokens (special tokens kept), each observation suffix as rendered;
3. after an observation, ``render(messages, add_generation_prompt=True)`` must start with the
   kept text: the rest (the template's glue, the observation, the next generation prompt) is
   tokenized and appended (loss mask 0). A template that renders earlier turns differently (it
   rewrites history, e.g. drops past reasoning) does not start with it: ``error`` raises naming
   the turn and the first differing token; ``split`` closes the training sample there and
   starts the next one from the re-rendered conversation (tokenized whole; its later model
   tokens are again kept as sampled).

The comparison is on text, so a tokenizer whose decode-then-encode is not the identity (a
sampled non-canonical split of a word) still trains the sampled tokens. Assumption: decoding a
turn's tokens alone gives the text they contribute (true of byte-level BPE and WordPiece-free
tokenizers; a SentencePiece tokenizer that drops a leading space at the start of a decode makes
the template check fail loudly, never splice silently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine_api.moe import NOT_ROUTED
from engine_api.rollout import Sample

Render = Callable[[list[dict]], str]  # messages -> text with the generation prompt


class HistoryMismatch(ValueError):
    """The chat template rewrote the kept history (``env.history_mismatch=error``)."""


@dataclass
class Segment:
    """One training sample of a trajectory: token ids and, per token, loss mask (1 exactly on
    the sampled tokens), sampling log-prob and weight version (0 off the model's tokens), and
    the assistant turn that sampled it (-1 elsewhere). ``routing``: with an engine that records
    MoE routing, the rows ``[positions, L, k]`` kept so far: each position's routing from the
    rollout call that first computed it (the sampled tokens' from the call that sampled them,
    a prompt's or an observation's from the next call's prefill, as a KV cache would keep them);
    the last position, which no forward fed, is ``NOT_ROUTED``."""

    ids: list[int]
    prompt_len: int
    mask: list[float] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    routing: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.log_probs, self.versions, self.turns = [0.0] * n, [0.0] * n, [0] * n, [-1] * n

    def extend(self, ids: Sequence[int], model: Sample | None = None, turn: int = -1) -> None:
        self.ids.extend(int(i) for i in ids)
        if model is None:
            self.mask += [0.0] * len(ids)
            self.log_probs += [0.0] * len(ids)
            self.versions += [0] * len(ids)
            self.turns += [-1] * len(ids)
        else:
            self.mask += [1.0] * len(ids)
            self.log_probs += model.log_probs.float().tolist()
            self.versions += model.versions().tolist()
            self.turns += [turn] * len(ids)

    @property
    def model_tokens(self) -> int:
        return int(sum(self.mask))

    def keep_routing(self, recorded: torch.Tensor, length: int) -> None:
        """Keep ``recorded``'s rows (one call's ``Sample.routed_experts`` over this segment's
        first ``length`` positions) for the positions not kept yet, but the call's last one."""
        have = sum(len(r) for r in self.routing)
        if len(recorded) != length:
            raise RuntimeError(f"the rollout recorded routing for {len(recorded)} positions, the call had {length}")
        if length - 1 > have:
            self.routing.append(recorded[have : length - 1].long().cpu())

    def routed_experts(self) -> torch.Tensor | None:
        """``[len(ids), L, k]`` of the kept routing (the last row ``NOT_ROUTED``), or None."""
        if not self.routing:
            return None
        rows = torch.cat(self.routing)
        pad = torch.full((len(self.ids) - len(rows), *rows.shape[1:]), NOT_ROUTED, dtype=torch.long)
        return torch.cat([rows, pad])


class Trajectory:
    """One trajectory's tokens and conversation (module docstring).

    Args:
        messages: the prompt's chat messages.
        prompt_ids: the prompt's tokens (``render(messages)`` tokenized).
        prompt_text: ``render(messages)``.
        tokenizer: decodes model turns and tokenizes observation suffixes.
        render: messages -> the template's text with the generation prompt (tools and
            template kwargs bound).
        budget: ``env.max_tokens``: the longest training sample.
        stop_ids: the stop token ids (an ending one is the template's end-of-turn token, left
            out of the assistant message's content).
        history_mismatch: ``error`` or ``split``.
    """

    def __init__(
        self,
        messages: list[dict],
        prompt_ids: Sequence[int],
        prompt_text: str,
        tokenizer,
        render: Render,
        budget: int,
        stop_ids: Sequence[int],
        history_mismatch: str = "error",
    ) -> None:
        self.messages = [dict(m) for m in messages]
        self.tok, self.render, self.budget = tokenizer, render, budget
        self.stop_ids, self.mode = {int(i) for i in stop_ids}, history_mismatch
        self.closed: list[Segment] = []
        self.current = Segment(list(prompt_ids), len(prompt_ids))
        self.text = prompt_text
        # (character offset, token offset, turn) where each piece of the kept text begins: to
        # name the first differing token of a rewritten history.
        self.pieces: list[tuple[int, int, int]] = [(0, 0, -1)]
        self.turns = 0
        self.truncated = False
        self.splits = 0
        self.last_text = self.last_answer = ""
        self.last_finish = ""
        # What the loop records per trajectory: the environment's rewards, tool calls and
        # error observations, and whether it has ended.
        self.rewards: list[float] = []
        self.calls = self.errors = self.cut_observations = 0
        self.done = False
        # The tools the loop runs for this trajectory's environment (name -> tool_runner.Tool), or None.
        self.tools: dict | None = None

    # ------------------------------------------------------------------ growth
    def room(self) -> int:
        """Tokens the next assistant turn may add within the budget."""
        return self.budget - len(self.current.ids)

    def next_turn_tokens(self, max_new_tokens: int) -> int | None:
        """How many tokens the next assistant turn may sample (``max_new_tokens`` within the
        budget); None when the trajectory cannot go on (ended, or out of budget: then flagged
        truncated and ended)."""
        if self.done:
            return None
        amount = min(max_new_tokens, self.room())
        if amount < 1:
            self.truncated, self.done = True, True
            return None
        return amount

    def add_turn(self, sample: Sample) -> str:
        """Keep one sampled assistant turn; returns its text: the decoded tokens, an ending stop
        token left out (``last_text``; ``last_answer``: special tokens left out, what
        ``reward.function`` scores)."""
        ids = sample.token_ids.tolist()
        turn = self.turns
        self.pieces.append((len(self.text), len(self.current.ids), turn))
        self.current.extend(ids, sample, turn)
        if sample.routed_experts is not None:
            self.current.keep_routing(sample.routed_experts, len(self.current.ids))
        content_ids = ids[:-1] if ids and sample.finish_reason == "stop" and ids[-1] in self.stop_ids else ids
        self.text += self._decode(ids)
        content = self._decode(content_ids)
        self.messages.append({"role": "assistant", "content": content})
        self.turns += 1
        self.last_finish = sample.finish_reason
        if sample.finish_reason == "length" and len(self.current.ids) >= self.budget:
            self.truncated = True
        self.last_text = content
        self.last_answer = self.tok.decode(content_ids, skip_special_tokens=True)
        return content

    def add_observation(self, messages: list[dict]) -> bool:
        """Append an observation's messages and the next generation prompt; returns whether the
        trajectory can go on (False: the budget ends it, flagged truncated, nothing appended).

        Raises:
            HistoryMismatch: the template rewrote the kept history and the mode is ``error``.
        """
        return self.continue_with([*self.messages, *messages])

    def continue_with(self, messages: list[dict]) -> bool:
        """The conversation is now ``messages`` (the kept one, its assistant turns as the raw
        text of their sampled tokens, and what came after them: an observation, or what an
        agent sent): its rendering with the next generation prompt must extend the kept text,
        and the rest is appended (module docstring); returns whether the trajectory can go on
        (False: the budget ends it, flagged truncated, nothing appended).

        Raises:
            HistoryMismatch: the template rewrote the kept history and the mode is ``error``.
        """
        self.messages = [dict(m) for m in messages]
        rendered = self.render(self.messages)
        if rendered.startswith(self.text):
            suffix = rendered[len(self.text) :]
            ids = list(self.tok(suffix, add_special_tokens=False)["input_ids"]) if suffix else []
            if len(self.current.ids) + len(ids) >= self.budget:  # no room left for one sampled token
                self.truncated = True
                return False
            self.pieces.append((len(self.text), len(self.current.ids), -1))
            self.current.extend(ids)
            self.text = rendered
            return True
        where = self._first_difference(rendered)
        if self.mode != "split":
            raise HistoryMismatch(
                f"the chat template renders the conversation before assistant turn {self.turns} differently from the tokens "
                f"kept ({where}): it rewrites earlier turns, so their sampled tokens cannot be kept; fix: "
                "env.history_mismatch=split (a new training sample from that turn), or a template that keeps history "
                "(e.g. chat_template_kwargs that keep reasoning)"
            )
        ids = list(self.tok(rendered, add_special_tokens=False)["input_ids"])
        if len(ids) >= self.budget:
            self.truncated = True
            return False
        self.closed.append(self.current)
        self.current = Segment(ids, len(ids))
        self.text, self.pieces, self.splits = rendered, [(0, 0, -1)], self.splits + 1
        return True

    def segments(self) -> list[Segment]:
        """The training samples: every segment holding a sampled token."""
        return [s for s in (*self.closed, self.current) if s.model_tokens]

    # ------------------------------------------------------------------ helpers
    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""

    def _first_difference(self, rendered: str) -> str:
        """Where ``rendered`` first departs from the kept text: the turn and the token."""
        pos = next((i for i, (a, b) in enumerate(zip(rendered, self.text, strict=False)) if a != b), min(len(rendered), len(self.text)))
        start, token, turn = max((p for p in self.pieces if p[0] <= pos), key=lambda p: p[0])
        ids = self.current.ids
        end = next((p[1] for p in self.pieces if p[1] > token), len(ids))
        # The first token of the piece whose decoded prefix passes the differing character.
        for k in range(token, end):
            if len(self._decode(ids[token : k + 1])) > pos - start:
                token = k
                break
        kind = f"assistant turn {turn}" if turn >= 0 else "the prompt or an observation"
        shown = self._decode([ids[token]]) if token < len(ids) else ""
        return (
            f"first difference at character {pos}, in {kind}: kept token {token} ({ids[token] if token < len(ids) else None}, "
            f"{shown!r}); the template writes {rendered[pos : pos + 20]!r} where the kept text has {self.text[pos : pos + 20]!r}"
        )


def bound_messages(messages: list[dict], limit: int) -> tuple[list[dict], bool]:
    """``messages`` with at most ``limit`` characters of content in all (the first messages
    whole, the one that crosses the limit cut, any after it empty), and whether any was cut.
    Done before the chat template runs, so an observation of megabytes costs nothing more than
    one that fills the budget (``env.max_observation_chars``)."""
    left, out, cut = limit, [], False
    for m in messages:
        content = m["content"]
        if len(content) > left:
            m, cut = {**m, "content": content[:left]}, True
        left -= len(m["content"])
        out.append(m)
    return out, cut


def message_list(observation: object, role: str, source: str, name: str) -> list[dict] | None:
    """An environment's observation as chat messages (``posttrain.agents.env``); None: none.

    Raises:
        ValueError: not a string, a message dict or a list of them (naming ``env.function``
            and the row)."""
    if observation is None:
        return None
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    items = [observation] if isinstance(observation, Mapping) else observation
    if (
        isinstance(items, (list, tuple))
        and items
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in items)
    ):
        return [dict(m) for m in items]
    raise ValueError(
        f"env.function = {name!r} (row {source}): the observation is a {type(observation).__name__} ({str(observation)[:60]!r}), "
        "not a string or chat messages with string role and content; fix: return text, or {'role': ..., 'content': str} "
        "message(s)"
    )
