"""``Rollout``: sample responses from a model whose weights are synced from the actor through
``export_weights`` (``BaseEngine.export_weights``, or a role delegating to it), on engine calls only.

The sampler itself is injected (``Sampler`` protocol), so ``roles/`` imports no model library;
``recipes/hf_sampler.py`` is the plain-HF CPU implementation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tensordict import TensorDict

from engine_api import make_batch
from engine_api.base import bucket_bytes, export_in_buckets


class WeightSource(Protocol):
    """Where the rollout's weights come from: an engine, or a role (``Actor`` or the legacy
    actor) exposing the same method."""

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` pairs, gathered one tensor or one ``bucket_mb`` bucket per
        collective (``BaseEngine.export_weights``). Collective."""


class Sampler(Protocol):
    """What ``Rollout`` needs from an inference model."""

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Replace the model's weights with ``(hf_name, tensor)`` pairs."""

    def sample(
        self, prompts: Sequence[torch.Tensor], max_new_tokens: int, temperature: float, top_p: float, generator: torch.Generator
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One response per 1-D prompt, in order: ``(response_ids, log_probs)``, where
        ``log_probs[i]`` is ``log softmax(logits / temperature)`` of ``response_ids[i]`` (before
        top-p filtering). Deterministic given ``generator``'s state and the prompts."""


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling.

    Attributes:
        max_new_tokens: response length cap.
        temperature: softmax temperature (> 0).
        top_p: nucleus sampling mass in (0, 1].
        seed: base seed; each ``generate`` call's generator is seeded with seed + call index.
        sync_bucket_mb: weight sync gathers the actor's weights in flat buckets of about this
            many MB, one collective per bucket (``export_weights(bucket_mb=...)``; 512, as in
            verl and NeMo-RL, keeps a ~1B model to a few collectives and extra memory to a few
            buckets); ``None``: one tensor per collective. The synced weights are the same
            either way. A source whose ``export_weights`` takes no ``bucket_mb`` (an engine
            written before it existed) is synced per tensor, with a warning.
    """

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    sync_bucket_mb: float | None = 512.0

    def _problems(self) -> list[str]:
        out = []
        if self.max_new_tokens < 1:
            out.append(f"max_new_tokens = {self.max_new_tokens}: must be >= 1; fix: e.g. 8")
        if self.temperature <= 0:
            out.append(f"temperature = {self.temperature}: must be > 0; fix: e.g. 1.0")
        if not 0 < self.top_p <= 1:
            out.append(f"top_p = {self.top_p}: must be in (0, 1]; fix: e.g. 1.0")
        try:
            bucket_bytes(self.sync_bucket_mb)
        except ValueError:
            out.append(
                f"sync_bucket_mb = {self.sync_bucket_mb!r}: must be a number > 0 of MB or null; fix: e.g. 512, or null for one tensor at a time"
            )
        return out


class Rollout:
    """Generates responses with the actor's current weights."""

    def __init__(self, source: WeightSource, sampler: Sampler, config: RolloutConfig) -> None:
        self.source = source
        self.sampler = sampler
        self.config = config
        self._calls = 0

    def sync_weights(self) -> None:
        """Copy the actor's weights into the sampler, gathered in ``sync_bucket_mb`` buckets.
        Collective: every rank drains the export."""
        self.sampler.load_weights(export_in_buckets(self.source.export_weights, self.config.sync_bucket_mb, "rollout.sync_bucket_mb"))

    def generate(self, prompts: Sequence[torch.Tensor], seed_offset: int | None = None) -> TensorDict:
        """Sample one response per prompt; returns a protocol batch of prompt + response with
        ``loss_mask`` on the response tokens, the sampling log-probs as ``rollout_log_probs``
        (0 on the prompt), the ``temperature`` metadata, and per-sample ``prompt_len``.

        Every rank samples the same responses (same seed), so the batch is the same global batch
        everywhere, as the roles expect. The generator is seeded with ``seed + seed_offset``
        (default: the number of earlier calls); recipes pass the step so a resumed run samples
        what the uninterrupted one would have.
        """
        c = self.config
        generator = torch.Generator().manual_seed(c.seed + (self._calls if seed_offset is None else seed_offset))
        self._calls += 1
        sequences, masks, log_probs = [], [], []
        responses = self.sampler.sample(list(prompts), c.max_new_tokens, c.temperature, c.top_p, generator)
        for prompt, (response, lp) in zip(prompts, responses, strict=True):
            sequences.append(torch.cat([prompt, response]))
            masks.append(torch.cat([torch.zeros(len(prompt)), torch.ones(len(response))]))
            log_probs.append(torch.cat([torch.zeros(len(prompt)), lp.float()]))
        return make_batch(
            sequences,
            loss_mask=masks,
            rollout_log_probs=log_probs,
            prompt_len=torch.tensor([len(p) for p in prompts]),
            temperature=c.temperature,
        )
