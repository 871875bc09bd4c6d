"""What the HTTP layer (``app``, ``registry``, ``routes``, ``wire``, ``proto``, ``futures``) and the
training side (``factory`` and the engines it holds: ``shared_engine``, ``ray_engine``; samplers:
``snapshots``) agree on.

The HTTP layer speaks the Tinker SDK's wire format and converts it into these plain types; the
training side never sees a pydantic model, a protobuf message or a request. Everything here is
torch tensors and Python scalars, so the training side can also be driven in process (the
fidelity tests do exactly that: the same :class:`DatumIn` through the server and straight into a
:class:`TrainingRun` must give equal results).

Errors: a method raises :class:`UserError` for anything the client got wrong (the HTTP layer
answers it with the SDK's error shape, category ``user``); any other exception is a server
error (category ``server``). A method that raises leaves the run's weights and optimizer as
they were. Each check runs once per request: the HTTP layer checks what it decodes (and the loss
request, ``datums.check_loss_request``) before it calls a run; a run checks what only it can
(the datums against the loss, the model's vocabulary and positions) and answers the engine's own
refusals (``ValueError``) as :class:`UserError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch


class UserError(ValueError):
    """A bad request: the message names the field, the value and the fix."""


@dataclass(frozen=True)
class DatumIn:
    """One training example.

    Attributes:
        tokens: the model input's token ids (the concatenated text chunks), ``[T]`` int64.
        inputs: ``loss_fn_inputs`` by name (``target_tokens`` ``[T]`` or ``[T, K]`` int64,
            ``weights``, ``advantages``, ``logprobs``, ``clip_low_threshold``, ...), each a tensor in
            the dtype and shape the client sent.
    """

    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]


@dataclass(frozen=True)
class ForwardBackwardOut:
    """Per datum outputs by name (``logprobs`` ``[T]`` or ``[T, K]`` float32, ``elementwise_loss``
    ``[T]``) and the call's metrics, keys ``name:reduction`` (``loss:sum``, ...)."""

    outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamIn:
    """``optim_step``'s hyperparameters (Tinker's AdamParams; ``grad_clip_norm`` 0 = no clipping)."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class LoraIn:
    """``create_model``'s LoRA settings (Tinker's LoraConfig)."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class SampleParamsIn:
    """Tinker's SamplingParams (``max_tokens`` None: the server's default)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SequenceOut:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "length" or "stop"


@dataclass(frozen=True)
class SampleOut:
    """``sequences`` (one per sample); ``prompt_logprobs`` when asked: one per prompt token, the
    first None (nothing predicts it)."""

    sequences: list[SequenceOut]
    prompt_logprobs: list[float | None] | None = None


class Sampler(Protocol):
    """One frozen set of weights to sample from (a base model, or a training run's snapshot)."""

    def sample(self, prompt: list[int], num_samples: int, params: SampleParamsIn, prompt_logprobs: bool) -> SampleOut: ...


class TrainingRun(Protocol):
    """A LoRA training run on one engine (possibly several ranks). Calls come one at a time,
    in the client's ``seq_id`` order (the HTTP layer guarantees it)."""

    base_model: str
    lora: LoraIn

    def forward_backward(
        self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict[str, float] | None, forward_only: bool
    ) -> ForwardBackwardOut:
        """The loss and per-datum log-probs of ``datums`` (gradients accumulated unless
        ``forward_only``); ``loss_fn`` / ``loss_fn_config`` as ``datums.check_loss_request``
        passed them."""
        ...

    def optim_step(self, adam: AdamIn) -> dict[str, float]: ...

    def save_state(self, directory: Path, with_optimizer: bool) -> None: ...

    def load_state(self, directory: Path, with_optimizer: bool) -> None: ...

    def sampler(self, directory: Path | None) -> Sampler:
        """A sampler of the current weights; also written to ``directory`` when given (a named
        ``save_weights_for_sampler``), so :meth:`RunFactory.load_sampler` can serve it later."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ChatModel:
    """What the OpenAI-compatible endpoint needs of a base model to serve chats.

    Attributes:
        tokenizer: its HF tokenizer (chats need its chat template; ``/completions`` does not).
        stop_token_ids: the ids that end an answer (EOS and the template's end of turn).
        tool_format: how its answers write tool calls (``hermes``, ``llama3``), None if unknown.
    """

    tokenizer: Any
    stop_token_ids: tuple[int, ...]
    tool_format: str | None


class RunFactory(Protocol):
    """Builds runs and samplers for the models the server serves."""

    def served_models(self) -> list[str]: ...

    def chat_model(self, base_model: str) -> ChatModel:
        """``base_model``'s tokenizer and chat facts (:class:`UserError` when it has no tokenizer)."""
        ...

    def create_run(self, base_model: str, lora: LoraIn) -> TrainingRun: ...

    def base_sampler(self, base_model: str) -> Sampler: ...

    def load_sampler(self, directory: Path) -> Sampler: ...

    def close(self) -> None: ...


@dataclass
class ServerSettings:
    """The HTTP layer's settings (``server.*`` of the config)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    state_dir: Path = Path("outputs/tinker")
    max_runs: int = 2
    max_body_bytes: int = 64 << 20
    poll_timeout_s: float = 30.0
    session_timeout_s: float = 60.0
    max_sample_tokens: int = 8192
    max_num_samples: int = 256
    tenants: bool = True
    max_runs_per_key: int = 8
    max_sampling_sessions_per_key: int = 256
    snapshots_per_model: int = 4
    ownerless_runs_owner: str | None = None
    log_level: str = "info"
    extra: dict = field(default_factory=dict)
