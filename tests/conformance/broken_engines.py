"""Plausible backend bugs, each one subclass of the reference engine, for the conformance
kit's teeth (``tests/conformance/test_kit.py``): the kit must fail every one of them."""

from __future__ import annotations

import contextlib
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

    def _step_spec(self):
        return dataclasses.replace(super()._step_spec(), grads_averaged_over_dp=False)


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
    """Its own ``train_mode`` (replacing BaseEngine's) loads the params but leaves the optimizer
    state where the offload put it (on a CPU machine no tensor device shows it)."""

    @contextlib.contextmanager
    def train_mode(self):
        self._offloader.load(model=True, optimizer=False)
        self.module.train()
        try:
            yield self
        finally:
            self._offloader.offload(model=self.config.offload.param, optimizer=self.config.offload.optimizer)


class SchedulerNeverSteps(ReferenceEngine):
    """``lr_scheduler_step`` reports the LR but never advances the scheduler (issue 28): every
    step trains at the first step's warmup LR, and resume stays consistent with itself."""

    def lr_scheduler_step(self) -> float:
        return self.scheduler.get_last_lr()[0]


class ForgetsTheRNGOnLoad(ReferenceEngine):
    """``load_checkpoint`` restores everything but the RNG (it puts back the state it had
    before the load): a resumed run draws other dropout masks than the uninterrupted one."""

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True) -> int:
        state = torch.get_rng_state()
        step = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        torch.set_rng_state(state)
        return step


class OnlyChecksTheGradNorm(ReferenceEngine):
    """Skips a step only for a non-finite grad norm: a non-finite loss whose gradient is finite
    (issue 28) is stepped on."""

    def optimizer_step(self) -> float:
        self.deferred.nonfinite_loss = False  # the loss flag, ignored
        return super().optimizer_step()


class OffloadFreesNothing(ReferenceEngine):
    """Records the offload and moves nothing (issue 28): on a CPU machine no device shows it,
    only the storage that stays allocated."""

    def _move(self, kind, load):
        if load:
            super()._move(kind, load)


class IgnoresDropout(ReferenceEngine):
    """Loads the model with its attention dropout switched off (as a converter that drops the
    setting would)."""

    def init_model(self) -> None:
        super().init_model()
        self.module.config.attention_dropout = 0.0
        for module in self.module.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.0


class ScalesTheLossSlightly(ReferenceEngine):
    """Every loss, and so every gradient, is (1 + 1e-4) times too large: the kit's tolerance
    must see a 1e-4 error."""

    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        if forward_only:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        real = self._loss_fn

        def scaled(mb, out, norm):
            loss, metrics = real(mb, out, norm)
            return loss * (1 + 1e-4), metrics

        self._loss_fn = scaled
        try:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        finally:
            self._loss_fn = real


class ScalesTheGradientSlightly(ReferenceEngine):
    """The gradient is (1 + 1e-4) times too large while the reported loss is right."""

    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        if forward_only:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        real = self._loss_fn

        def scaled(mb, out, norm):
            loss, metrics = real(mb, out, norm)
            return loss * (1 + 1e-4) - loss.detach() * 1e-4, metrics

        self._loss_fn = scaled
        try:
            return super().forward_backward_step(batch, ctx, forward_only, preprocess_fn, postprocess_fn)
        finally:
            self._loss_fn = real


class ScalesLogProbsSlightly(ReferenceEngine):
    """Log-probs (1 + 1e-4) times too large."""

    def _forward(self, mb):
        out = super()._forward(mb)
        if "log_probs" in out.keys():
            out["log_probs"] = out["log_probs"] * (1 + 1e-4)
        return out


class OneWeightOffAfterLoad(ReferenceEngine):
    """``load_checkpoint`` leaves one element of one weight one float step off."""

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True) -> int:
        step = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        with torch.no_grad():
            w = next(self.module.parameters()).view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
        return step


class Fp32UnderBf16(ReferenceEngine):
    """Accepts ``model.dtype=bfloat16`` and keeps computing in fp32 (fp32 parameters under a
    bf16 setting: the megatron engine's state before issue 52, where it then crashed)."""

    @classmethod
    def check_config(cls, config):
        return []


class ChecksNoParameterAfterTheStep(ReferenceEngine):
    """The post-step finite check sees no parameter (a backend whose ``_updated_parameters``
    hook yields nothing, e.g. after renaming its module)."""

    def _updated_parameters(self):
        return iter(())


class UnshardsInReverseRankOrder(ReferenceEngine):
    """``unshard_data`` puts the ranks' contiguous shards back in reverse rank order."""

    def unshard_data(self, data):
        from tensordict import TensorDict

        whole = super().unshard_data(data)
        n, per = whole.batch_size[0], data.batch_size[0]
        order = [i for start in range(n - per, -1, -per) for i in range(start, start + per)]
        fields = {}
        for key in whole.keys():
            value = whole.get(key)
            if value.is_nested:
                rows = value.unbind()
                fields[key] = torch.nested.nested_tensor([rows[i] for i in order], layout=torch.jagged)
            else:
                fields[key] = value[order]
        return TensorDict(fields, batch_size=[n])


class SwapsWithoutTheMoments(ReferenceEngine):
    """``run_state`` leaves the optimizer's per-parameter state out: a run swapped back in
    steps with zeroed moments (issue 55)."""

    def run_state(self):
        state = super().run_state()
        state.optim = [[None] * len(per) for per in state.optim]
        return state


class KeepsTheValueBias(ReferenceEngine):
    """Builds every value head with a bias, ``model.value_bias`` ignored (its values still equal
    HF's at initialisation: the bias starts at 0)."""

    @staticmethod
    def _bias_free(score):
        return score
