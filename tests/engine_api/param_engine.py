"""``ParamEngine``: ``BaseEngine`` over a few given parameters and an optimizer, no model.

It drives the one optimizer-step skeleton (``BaseEngine.optimizer_step``: deferred scale, global
norm, agreed skip, clip, update, post-step finite check) on tensors a test controls exactly,
with the default hooks every plain-torch backend uses. Forward, checkpoints and export are not
part of it (they raise)."""

from __future__ import annotations

import torch

from engine_api.config import EngineConfig, OptimConfig
from engine_api.kit import BaseEngine


class ParamEngine(BaseEngine):
    """``params``: name -> Parameter (their ``.grad`` set by the test); ``optimizer`` over them."""

    def __init__(self, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer, clip_grad: float | None = None):
        super().__init__(EngineConfig(optim=OptimConfig(clip_grad=clip_grad)))
        self.module = torch.nn.Module()
        for name, param in params.items():
            self.module.register_parameter(name, param)
        self.optimizer = optimizer

    def _build_model(self) -> None:
        pass

    def _modules(self) -> list[torch.nn.Module]:
        return [self.module]

    def _step_spec(self):
        raise NotImplementedError("ParamEngine has no forward")

    dp_rank, dp_size, dp_group = 0, 1, None

    def _save_checkpoint(self, *args) -> None:
        raise NotImplementedError

    def _load_checkpoint(self, *args) -> dict:
        raise NotImplementedError

    def _export_weights(self, bucket_bytes):
        raise NotImplementedError
