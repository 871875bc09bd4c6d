"""Plausible rollout-backend bugs, each one subclass of the ``hf`` backend, for the rollout
conformance kit's teeth (``tests/conformance/test_rollout_kit.py``): the kit must fail every one
of them on the check that guards that duty."""

from __future__ import annotations

import dataclasses

import torch

from backends.rollout.hf import HFRollout
from engine_api.rollout import Sample


class SkipsFinish(HFRollout):
    """``finish_weight_update`` marks the new version but the staged weights are never loaded
    (as when the load is queued on a worker that never runs it)."""

    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        return None


class IgnoresTemperature(HFRollout):
    """Samples and reports log-probs of the raw logits whatever ``temperature`` says."""

    def _generate(self, prompts, params, seeds):
        return super()._generate(prompts, dataclasses.replace(params, temperature=1.0), seeds)


class DropsLastChunk(HFRollout):
    """Loads every tensor of an update but the last one it received (an off-by-one over the
    staged chunks); the base's completeness check cannot see it, the weights arrived."""

    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        super()._apply_weights(dict(list(weights.items())[:-1]))


class SharedGenerator(HFRollout):
    """Draws the whole call from one generator seeded with the first prompt's seed (as an
    engine with one global seed does): a prompt's samples depend on the other prompts."""

    @torch.no_grad()
    def _generate(self, prompts, params, seeds):
        shared = torch.Generator().manual_seed(int(seeds[0]))
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                groups.setdefault(len(prompt), []).append((i, j))
        out = [[None] * params.n for _ in prompts]
        for members in groups.values():
            block = torch.stack([prompts[i] for i, _ in members]).to(self.device)
            for (i, j), (ids, lps, reason) in zip(members, self._sample_block(block, params, [shared] * len(members)), strict=True):
                out[i][j] = Sample(ids, lps, reason, self.weight_version)
        return out


class ReportsWholeVocabLogProbs(HFRollout):
    """Samples from the top-k / top-p set but reports each token's log-prob under the whole
    vocabulary (as vLLM does unless ``logprobs_mode=processed_logprobs``): the trainer's and
    the sampler's distributions then disagree whenever the set is truncated."""

    @torch.no_grad()
    def _generate(self, prompts, params, seeds):
        out = []
        for prompt, group in zip(prompts, super()._generate(prompts, params, seeds), strict=True):
            row = []
            for s in group:
                ids = torch.cat([prompt, s.token_ids]).to(self.device)
                logits = self.model(ids[None]).logits[0, len(prompt) - 1 : len(ids) - 1].float() / params.temperature
                whole = torch.log_softmax(logits, -1).gather(-1, s.token_ids[:, None].to(self.device))[:, 0]
                row.append(dataclasses.replace(s, log_probs=whole.cpu()))
            out.append(row)
        return out
