"""One session of the gateway: one trajectory, kept token in and token out while an external agent
talks to it through the OpenAI chat-completions API.

An agent sends its whole conversation with every call. The session keeps the tokens it sampled
(``posttrain.agents.trajectory.Trajectory``: ids, log-probs, weight versions, routing, loss mask
1 exactly on them) and maps what comes back onto them:

* each assistant message of the request that is one the session answered (the k-th assistant
  message against the k-th answer: the same tool-call ids, or the same calls, or the same text)
  is replaced by the raw text of its sampled tokens (tool-call markup included), so the chat
  template renders what was sampled, never what a framework re-serialised;
* the conversation so rebuilt is rendered with the generation prompt and must extend the kept
  text; the rest (tool results, user turns, the template's glue, the next generation prompt) is
  tokenized and kept with loss mask 0. A request that changes the past (an edited message, a
  dropped turn, a rewritten answer, other tools) does not extend it: ``env.history_mismatch``
  decides, as for environments: ``error`` answers 400 naming the turn and the first differing
  token, ``split`` starts a new training sample from the re-rendered conversation;
* a ``tool`` message must answer a call id the session issued (or one of an assistant message in
  the same request): an unknown id is refused (400).

The answer's ``tool_calls`` are parsed from the sampled text with the run's tool-call format
(``env.tool_format``), each with a fresh id (``posttrain.gateway.chat``, which the Tinker server's
OpenAI endpoint shares). Nothing sampled is ever decoded and re-encoded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine_api.rollout import Sample, sample_seed
from posttrain.agents.trajectory import HistoryMismatch, Trajectory
from posttrain.gateway.chat import Answer, answer_of, renderer, token_logprobs
from posttrain.gateway.wire import ChatRequest, WireError, choice, completion


@dataclass(frozen=True)
class SessionLimits:
    """What every session of a run shares.

    Attributes:
        max_tokens: ``env.max_tokens``: the longest training sample.
        max_new_tokens: ``rollout.max_new_tokens``: the most one call samples.
        max_calls: ``agent.max_calls``.
        history_mismatch: ``env.history_mismatch``.
        tool_format: the resolved tool-call format (``hermes``, ``llama3``) or None.
        strict_sampling: ``agent.request_sampling == "strict"``.
        temperature, top_p, top_k: the run's rollout sampling settings.
        model_name: ``agent.model_name``.
    """

    max_tokens: int
    max_new_tokens: int
    max_calls: int
    history_mismatch: str
    tool_format: str | None
    strict_sampling: bool
    temperature: float
    top_p: float
    top_k: int
    model_name: str


@dataclass
class Session:
    """One trajectory behind the API (module docstring).

    Attributes:
        id: unguessable (``secrets.token_urlsafe``); its URL is the agent's ``base_url``.
        meta: the data row (``PromptSample``): its columns go to the agent and the reward.
        seed: the trajectory's seed (call ``k`` samples with ``sample_seed(seed, k)``).
        trajectory: the kept tokens, from the first call on.
        record: every call's sample, in order.
        overrides: calls whose sampling settings were overridden by the run's.
    """

    id: str
    meta: Any
    seed: int
    tokenizer: Any
    template_kwargs: dict
    stop_ids: list[int]
    limits: SessionLimits
    lock: threading.Lock
    trajectory: Trajectory | None = None
    record: list[Sample] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    overrides: int = 0
    prompt_text: str = ""

    @property
    def calls(self) -> int:
        return len(self.record)

    # ------------------------------------------------------------------ a call
    def prepare(self, req: ChatRequest) -> tuple[list[int], int, int, tuple[str, ...]]:
        """Check ``req`` against the session and keep its new tokens: ``(prompt ids, seed, new
        tokens, stop strings)`` of the sample to draw.

        Raises:
            WireError: the request is refused (nothing of it is kept).
        """
        lim = self.limits
        if self.calls >= lim.max_calls:
            raise WireError(
                f"this session made agent.max_calls = {lim.max_calls} calls; fix: end the episode (or raise agent.max_calls)",
                code="max_calls",
            )
        self._check_sampling(req)
        messages = self._canonical(req.messages)
        with self.lock:  # the tokenizer and the template are shared by every session's thread
            render = renderer(self.tokenizer, req.tools or None, self.template_kwargs)
            try:
                fits = self._extend(messages, render)
            except HistoryMismatch as exc:
                raise WireError(f"{exc} (env.history_mismatch = error)", code="history_mismatch") from None
            except WireError:
                raise
            except Exception as exc:  # noqa: BLE001 (the template's or tokenizer's own error)
                raise WireError(
                    f"the chat template could not render the messages ({type(exc).__name__}: {exc})", param="messages"
                ) from None
        t = self.trajectory
        amount = min(req.max_tokens or lim.max_new_tokens, lim.max_new_tokens, t.room())
        if not fits or amount < 1:
            t.truncated = True
            raise WireError(
                f"the conversation has {len(t.current.ids)} tokens and the session's budget is env.max_tokens = {lim.max_tokens}: "
                "no room for an answer; fix: end the episode (the trajectory is trained as it is, flagged truncated)",
                code="context_length_exceeded",
            )
        seed = sample_seed(self.seed, self.calls) if req.seed is None else sample_seed(sample_seed(self.seed, req.seed), self.calls)
        return list(t.current.ids), seed, amount, req.stop

    def accept(self, req: ChatRequest, sample: Sample, prompt_tokens: int) -> dict[str, Any]:
        """Keep ``sample`` (the call's tokens as sampled) and answer the call."""
        with self.lock:
            content = self.trajectory.add_turn(sample)
        self.record.append(sample)
        tools_on = bool(req.tools) and req.tool_choice != "none"
        answer = answer_of(content, sample.finish_reason == "length", self.limits.tool_format, tools_on)
        self.answers.append(answer)
        logprobs = None
        if req.logprobs:
            with self.lock:
                logprobs = token_logprobs(self.tokenizer, sample.token_ids.tolist(), sample.log_probs.tolist())
        picked = choice(0, answer.content, answer.calls, answer.finish, logprobs)
        return completion(self.limits.model_name, [picked], prompt_tokens, len(sample.token_ids))

    def last_answer(self) -> str:
        """The text of the last answer without special tokens (what ``reward.function`` scores)."""
        return self.trajectory.last_answer if self.trajectory is not None else ""

    # ------------------------------------------------------------------ internals
    def _check_sampling(self, req: ChatRequest) -> None:
        lim = self.limits
        asked = {"temperature": (req.temperature, lim.temperature), "top_p": (req.top_p, lim.top_p), "top_k": (req.top_k, lim.top_k)}
        differ = {k: v for k, (v, run) in asked.items() if v is not None and v != run}
        if differ and lim.strict_sampling:
            named = ", ".join(f"{k} = {v!r} (the run samples with {asked[k][1]!r})" for k, v in differ.items())
            raise WireError(
                f"{named}: the policy trained is the one sampled; fix: leave them out (agent.request_sampling = strict)",
                param=next(iter(differ)),
            )
        self.overrides += bool(differ)

    def _canonical(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request's conversation with each answer of this session as its sampled text, a
        ``developer`` message as ``system``; tool results must answer a known call."""
        out, k = [], 0
        issued = {c["id"] for a in self.answers for c in a.calls}
        in_request = {c["id"] for m in messages for c in m.get("tool_calls", ()) if c.get("id")}
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and k < len(self.answers):
                if _same(m, self.answers[k]):
                    out.append({"role": "assistant", "content": self.answers[k].raw})
                    k += 1
                    continue
                k = len(self.answers)  # the history was rewritten from here: the template check decides
            if m["role"] == "tool" and m["tool_call_id"] not in issued | in_request:
                raise WireError(
                    f"messages[{i}]: a tool message for call id {m['tool_call_id']!r}, which no answer of this session issued; "
                    "fix: answer the tool_calls of the last assistant message with their ids",
                    param=f"messages[{i}]",
                )
            out.append({**m, "role": "system"} if m["role"] == "developer" else dict(m))
        return out

    def _extend(self, messages: list[dict[str, Any]], render) -> bool:
        lim = self.limits
        if self.trajectory is None:
            text = render(messages)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(ids) >= lim.max_tokens:
                raise WireError(
                    f"the first messages render to {len(ids)} tokens, not below env.max_tokens = {lim.max_tokens}; fix: a shorter prompt",
                    code="context_length_exceeded",
                )
            self.prompt_text = text
            self.trajectory = Trajectory(messages, ids, text, self.tokenizer, render, lim.max_tokens, self.stop_ids, lim.history_mismatch)
            return True
        self.trajectory.render = render  # other tools render another system prompt: the history check sees it
        return self.trajectory.continue_with(messages)


def _same(m: dict[str, Any], answer: Answer) -> bool:
    """Whether assistant message ``m`` is ``answer`` as the agent sends it back."""
    got = m.get("tool_calls") or []
    if answer.calls:
        if {c["id"] for c in got} == {c["id"] for c in answer.calls}:
            return True
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer.calls]
        return [(c["function"]["name"], c["function"]["arguments"]) for c in got] == want
    return not got and (m.get("content") or "").strip() == (answer.content or "").strip()
