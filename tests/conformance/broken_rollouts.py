"""Plausible rollout-backend bugs, each one subclass of the ``hf`` backend, for the rollout
conformance kit's teeth (``tests/conformance/test_rollout_kit.py``): the kit must fail every one
of them on the check that guards that duty."""

from __future__ import annotations

import copy
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


# ----------------------------------------------------------------------------- partial rollouts
class DropsKept(HFRollout):
    """Continues an unfinished sample but returns only the new tokens (the kept ones are lost)."""

    def generate(self, prompts, params, seeds, kept=None):
        out = super().generate(prompts, params, seeds, kept=kept)
        if kept is None:
            return out
        cut = [0 if k is None else len(k.token_ids) for k in kept]
        return [
            [dataclasses.replace(g[0], token_ids=g[0].token_ids[c:], log_probs=g[0].log_probs[c:], token_versions=None)]
            for g, c in zip(out, cut, strict=True)
        ]


class RescoresKept(HFRollout):
    """Reports the kept tokens' log-probs as the new weights score them (not the version that sampled them)."""

    @torch.no_grad()
    def generate(self, prompts, params, seeds, kept=None):
        out = super().generate(prompts, params, seeds, kept=kept)
        if kept is None:
            return out
        fixed = []
        for prompt, g in zip(prompts, out, strict=True):
            s = g[0]
            ids = torch.cat([torch.as_tensor(prompt), s.token_ids]).to(self.device)
            logits = self.model(ids[None]).logits[0, len(prompt) - 1 : len(ids) - 1].float() / params.temperature
            rescored = torch.log_softmax(logits, -1).gather(-1, s.token_ids[:, None].to(self.device))[:, 0].cpu()
            fixed.append([dataclasses.replace(s, log_probs=rescored)])
        return fixed


class StampsNewest(HFRollout):
    """Stamps every token of a continued sample with the newest version (staleness then counts
    from the newest, not the oldest)."""

    def generate(self, prompts, params, seeds, kept=None):
        out = super().generate(prompts, params, seeds, kept=kept)
        return [[dataclasses.replace(g[0], token_versions=None)] if len(g) == 1 else g for g in out]


class StaleCache(HFRollout):
    """Pauses and continues keeping the kept tokens' cache computed under the previous weights
    (a native pause that does not recompute the prefix after an update): the prefill of a
    continuation runs with the weights before the update, its decoding with the new ones."""

    _previous = None
    _continuing = False

    def _apply_weights(self, weights):
        self._previous = copy.deepcopy(self.model)
        super()._apply_weights(weights)

    def generate(self, prompts, params, seeds, kept=None):
        self._continuing = kept is not None and any(k is not None for k in kept)
        try:
            return super().generate(prompts, params, seeds, kept=kept)
        finally:
            self._continuing = False

    def _sample_block(self, prompts, params, gens):
        current, previous = self.model, self._previous
        if previous is None or not self._continuing:
            return super()._sample_block(prompts, params, gens)
        calls = []

        def mixed(*args, **kwargs):  # the prefill under the old weights, every later forward under the new
            calls.append(1)
            return (previous if len(calls) == 1 else current)(*args, **kwargs)

        self.model = mixed
        try:
            return super()._sample_block(prompts, params, gens)
        finally:
            self.model = current


class ScoresShifted(HFRollout):
    """Prompt log-probs scored one position late: each token by the logits at its own position."""

    @torch.no_grad()
    def _prompt_log_probs(self, prompts):
        out = []
        for prompt in prompts:
            ids = prompt[None]
            logits = self.model(input_ids=ids, use_cache=False).logits[0, 1:].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
        return out


class EndsAtEos(HFRollout):
    """Stops at the model's own EOS (``eos_token_id`` of its generation config) as well as the
    caller's stop ids: vLLM's default (``ignore_eos=False``)."""

    def _generate(self, prompts, params, seeds):
        import json
        import os

        with open(os.path.join(self.config.model_path, "generation_config.json")) as f:
            eos = json.load(f)["eos_token_id"]
        return super()._generate(prompts, dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, eos)), seeds)


class IgnoresStopStrings(HFRollout):
    """Honours ``stop_token_ids`` but drops the ``stop`` strings (as a backend that never
    detokenizes does)."""

    def _generate(self, prompts, params, seeds):
        return super()._generate(prompts, dataclasses.replace(params, stop=()), seeds)


class ReseedsGlobalRNG(HFRollout):
    """Seeds the process's global RNGs with the call's first seed before sampling (as an engine
    that calls ``set_random_seed`` per request does): the trainer's streams restart every call."""

    def _generate(self, prompts, params, seeds):
        import random

        import numpy as np

        random.seed(int(seeds[0]))
        np.random.seed(int(seeds[0]) % 2**32)
        torch.manual_seed(int(seeds[0]))
        return super()._generate(prompts, params, seeds)
