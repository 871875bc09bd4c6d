"""Plausible backend bugs, each one subclass of the reference engine, for the conformance
kit's teeth (``tests/conformance/test_kit.py``): the kit must fail every one of them."""

from __future__ import annotations

import dataclasses

import torch

from engine_api import kit
from tests.reference_engine import ReferenceEngine


class IgnoresTemperature(ReferenceEngine):
    """Computes log-probs and entropy of the raw logits whatever the metadata ``temperature``."""

    def _forward(self, mb):
        mb = mb.copy()
        mb.set_non_tensor("temperature", 1.0)
        return super()._forward(mb)


class AppliesAMicroBatchTwice(ReferenceEngine):
    """Back-propagates the first micro-batch of every training call twice (its reported loss
    stays right: only the gradient is doubled, as when a hook re-runs a backward)."""

    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        if forward_only:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        real, first = self._loss_fn, [True]

        def twice(mb, out, norm):
            loss, metrics = real(mb, out, norm)
            if first[0]:
                first[0] = False
                return 2 * loss - loss.detach(), metrics
            return loss, metrics

        self._loss_fn = twice
        try:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        finally:
            self._loss_fn = real


class SkipsDPNormalisation(ReferenceEngine):
    """Claims its gradients are summed over DP while DDP averages them: on N ranks every
    gradient is N times too small (invisible on 1 rank)."""

    def _spec(self):
        return dataclasses.replace(super()._spec(), grads_averaged_over_dp=False)


class ChangesStateOnBadBatch(ReferenceEngine):
    """Nudges the weights before noticing that a batch is bad (a partial update, then the error)."""

    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        try:
            kit.validate_batch(batch, vocab_size=self.module.config.vocab_size)
        except ValueError:
            with torch.no_grad():
                next(self.module.parameters()).add_(1e-3)
            raise
        return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)


class TrainsWithTheOptimizerOffloaded(ReferenceEngine):
    """``train_mode`` loads the params but leaves the optimizer state where the offload put it
    (the issue-19 audit's survivor: on a CPU machine no tensor device shows it)."""

    def _load(self, model, optimizer):
        super()._load(model=model, optimizer=False)
