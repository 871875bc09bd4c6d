"""A deterministic training side for the HTTP layer's wire tests (no model, no engine).

Every number it returns is a known function of its input and its state, so a test can say what
the SDK must decode: a datum's logprobs are ``fake_logprob(target_token, step)`` (``step``: the
optimizer steps taken), the elementwise loss is ``-logprob * weight``, ``loss:sum`` their sum.
Sampled tokens continue the prompt (``last + step + sample + k``). Every call is recorded with
the thread it ran on, so a test can also check what did *not* happen and that all calls ran on one
thread.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from tinker_server.contract import (
    AdamIn,
    ChatModel,
    DatumIn,
    ForwardBackwardOut,
    LoraIn,
    SampleOut,
    SampleParamsIn,
    SequenceOut,
    UserError,
)

MODEL = "fake/tiny-lm"
OTHER = "fake/other-lm"  # served too: same shapes, other weights
VOCAB = 1000
DEFAULT_MAX_TOKENS = 4


def fake_logprob(token: torch.Tensor | float, step: int):
    """The logprob FakeRun gives ``token`` after ``step`` optimizer steps."""
    return -(0.01 * token + 0.1 * step + 0.5)


class FakeSampler:
    def __init__(self, factory: FakeFactory, step: int, source: str):
        self.factory, self.step, self.source = factory, step, source

    def sample(self, prompt: list[int], num_samples: int, params: SampleParamsIn, prompt_logprobs: bool) -> SampleOut:
        self.factory.wait_for_hold()
        self.factory.record(
            "sample", self.source, prompt=list(prompt), num_samples=num_samples, params=params, prompt_logprobs=prompt_logprobs
        )
        if self.factory.replies is not None:  # scripted answers (the OpenAI endpoint's tests)
            sequences = [
                SequenceOut(tokens=list(r), logprobs=[-0.25 * (k + 1) for k in range(len(r))], stop_reason="stop")
                for r in self.factory.replies[:num_samples]
            ]
            return SampleOut(sequences=sequences)
        n = params.max_tokens or DEFAULT_MAX_TOKENS
        sequences = [
            SequenceOut(
                tokens=[(prompt[-1] + self.step + i + k) % VOCAB for k in range(n)],
                logprobs=[-0.25 * (k + 1) for k in range(n)],
                stop_reason="length",
            )
            for i in range(num_samples)
        ]
        lps = [None] + [float(fake_logprob(t, self.step)) for t in prompt[1:]] if prompt_logprobs else None
        return SampleOut(sequences=sequences, prompt_logprobs=lps)


class FakeRun:
    def __init__(self, factory: FakeFactory, base_model: str, lora: LoraIn):
        self.factory, self.base_model, self.lora = factory, base_model, lora
        self.step = 0
        self.adam: list[AdamIn] = []
        self.closed = False
        self.calls: list[tuple[str, dict]] = []
        self.datums: list[DatumIn] = []  # every datum forward_backward received, in order

    def _record(self, name: str, **detail) -> None:
        assert not self.closed, f"{name} on a closed run"
        self.calls.append((name, detail))
        self.factory.record(name, self)

    def forward_backward(
        self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict[str, float] | None, forward_only: bool
    ) -> ForwardBackwardOut:
        self.factory.wait_for_hold()
        self._record("forward_backward", loss_fn=loss_fn, config=loss_fn_config, forward_only=forward_only, n=len(datums))
        self.datums.extend(datums)
        outputs, total = [], 0.0
        for d in datums:
            target = d.inputs["target_tokens"]
            logprobs = fake_logprob(target.to(torch.float32), self.step)
            weights = d.inputs.get("weights", torch.ones(target.shape[0]))
            loss = -(logprobs * (weights if logprobs.ndim == weights.ndim else weights[:, None]))
            outputs.append({"logprobs": logprobs, "elementwise_loss": loss.reshape(loss.shape[0], -1).sum(-1)})
            total += float(loss.sum())
        return ForwardBackwardOut(outputs=outputs, metrics={"loss:sum": total, "datums:sum": float(len(datums))})

    def optim_step(self, adam: AdamIn) -> dict[str, float]:
        self._record("optim_step", adam=adam)
        self.adam.append(adam)
        self.step += 1
        return {"step:max": float(self.step)}

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        self._record("save_state", directory=directory, with_optimizer=with_optimizer)
        if self.factory.fail_saves:
            (directory / "partial").write_text("half a checkpoint")
            raise OSError(28, "No space left on device")
        state = {"step": self.step, "lora_rank": self.lora.rank, "adam": [a.learning_rate for a in self.adam] if with_optimizer else None}
        (directory / "fake_state.json").write_text(json.dumps(state))

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        state = json.loads((directory / "fake_state.json").read_text())
        if state["lora_rank"] != self.lora.rank:
            raise UserError(f"path: rank {state['lora_rank']} checkpoint, rank {self.lora.rank} run")
        self._record("load_state", directory=directory, with_optimizer=with_optimizer)
        self.step = state["step"]
        if with_optimizer:
            self.adam = [AdamIn(learning_rate=lr) for lr in state["adam"]]

    def sampler(self, directory: Path | None) -> FakeSampler:
        self._record("sampler", directory=directory)
        if directory is not None:
            (directory / "fake_sampler.json").write_text(json.dumps({"step": self.step}))
        return FakeSampler(self.factory, self.step, f"snapshot@{self.step}")

    def close(self) -> None:
        self._record("close")
        self.closed = True


class FakeFactory:
    """Builds :class:`FakeRun` s; ``log`` holds (call, source, detail, thread id) of every training-side call."""

    def __init__(self):
        self.runs: list[FakeRun] = []
        self.log: list[tuple[str, object, dict, int]] = []
        self.closed = False
        self.fail_saves = False  # save_state writes part of a checkpoint, then fails (a full disk)
        self.hold: threading.Event | None = None  # set: sample() and forward_backward() wait for it (keep the worker busy)
        self.entered = threading.Event()  # set when a call starts waiting for `hold` (the worker is in the call)
        self.replies: list[list[int]] | None = None  # set: sample() answers these token lists (one per sample)
        self._chat: ChatModel | None = None

    def wait_for_hold(self) -> None:
        if self.hold is not None:
            self.entered.set()
            self.hold.wait(10)

    def record(self, name: str, source: object, **detail) -> None:
        self.log.append((name, source, detail, threading.get_ident()))

    @property
    def live(self) -> list[FakeRun]:
        return [r for r in self.runs if not r.closed]

    def served_models(self) -> list[str]:
        self.record("served_models", None)
        return [MODEL, OTHER]

    def chat_model(self, base_model: str) -> ChatModel:
        """A ChatML character tokenizer with Qwen's tool-call tags (the agents' tests' own)."""
        self.record("chat_model", base_model)
        if self._chat is None:
            from posttrain.agents.tools import detect_format
            from tests.agents.scripted import HERMES, _chat_tokenizer

            tok = _chat_tokenizer(HERMES)
            self._chat = ChatModel(tok, (tok.convert_tokens_to_ids("<|im_end|>"),), detect_format(tok.chat_template))
        return self._chat

    def create_run(self, base_model: str, lora: LoraIn) -> FakeRun:
        self.record("create_run", base_model)
        run = FakeRun(self, base_model, lora)
        self.runs.append(run)
        return run

    def base_sampler(self, base_model: str) -> FakeSampler:
        self.record("base_sampler", base_model)
        return FakeSampler(self, 0, "base")

    def load_sampler(self, directory: Path) -> FakeSampler:
        self.record("load_sampler", directory)
        return FakeSampler(self, json.loads((directory / "fake_sampler.json").read_text())["step"], f"loaded:{directory.name}")

    def close(self) -> None:
        self.record("close", None)
        self.closed = True
