"""A reference engine over a plain torch model: proof that a backend is "subclass + register".

Not registered by default: tests call :func:`register` (idempotent per process). It uses
engine_api for everything shared (validation, micro-batching, packing, normalization, LR
schedule) and torch DDP for data parallelism, so the invariance tests of the shared logic run
without any real backend. The model is a one-block causal transformer whose attention is
restricted by segment ids, so packed rows never attend across sequences.

Model directory format (the stand-in for an HF directory): ``tiny.json`` with the
dimensions and ``model.pt`` with the state dict; see :func:`save_tiny_model`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from tensordict import TensorDict

from engine_api import BaseEngine, register_engine, unregister_engine
from engine_api.batch import pack, pad, unpack
from engine_api.dist import group_rank, group_size, is_initialized
from engine_api.logprobs import token_entropy, token_log_probs
from engine_api.losses import DeferredNormalizer
from engine_api.lr_schedule import build_lr_scheduler
from engine_api.optim import build_adamw, clip_and_step
from engine_api.step import StepSpec, forward_backward_loop

NAME = "reference"


class TinyCausalLM(nn.Module):
    """Embedding + learned positions, one single-head attention block, MLP, LM head."""

    def __init__(self, vocab_size: int = 32, dim: int = 16, max_positions: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_positions, dim)
        # No qkv bias: the key bias has an exactly-zero true gradient (softmax is shift-invariant), and
        # Adam would amplify its float noise by 1/eps, making updates compare noise, not the engine.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.Tanh(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, T, V]``; token i attends to j <= i of the same segment (-1 = padding)."""
        h = self.embed(input_ids) + self.pos(position_ids)
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        T = input_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed = causal & same & (segment_ids[:, None, :] >= 0)
        allowed |= torch.eye(T, dtype=torch.bool, device=h.device)  # padding rows attend to themselves: no NaN
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))
        h = h + self.mlp(self.norm(h))
        return self.head(h)


def save_tiny_model(path: str, seed: int = 0, **dims) -> str:
    """Create a seeded :class:`TinyCausalLM` and save it in the reference directory format."""
    torch.manual_seed(seed)
    model = TinyCausalLM(**dims)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tiny.json"), "w") as f:
        json.dump(dims, f)
    torch.save(model.state_dict(), os.path.join(path, "model.pt"))
    return path


def load_tiny_model(path: str) -> TinyCausalLM:
    """Load a model saved by :func:`save_tiny_model`."""
    with open(os.path.join(path, "tiny.json")) as f:
        model = TinyCausalLM(**json.load(f))
    model.load_state_dict(torch.load(os.path.join(path, "model.pt"), weights_only=True))
    return model


class ReferenceEngine(BaseEngine):
    """BaseEngine over :class:`TinyCausalLM`, DP with torch DDP over the default group."""

    def init_model(self) -> None:
        """Load the model, wrap it in DDP when running on several ranks, build AdamW + LR."""
        self.module = load_tiny_model(self.config.model.path)
        self.model = nn.parallel.DistributedDataParallel(self.module) if self.dp_size > 1 else self.module
        self.optimizer = build_adamw(self.module.parameters(), self.config.optim)
        self.scheduler = build_lr_scheduler(self.optimizer, self.config.optim)
        self.deferred = DeferredNormalizer(self.config.loss_agg_mode, self.config.loss_agg_constant)
        self.global_step = 0

    @contextlib.contextmanager
    def train_mode(self):
        self.module.train()
        yield self

    @contextlib.contextmanager
    def eval_mode(self):
        self.module.eval()
        yield self

    @property
    def dp_rank(self) -> int:
        return group_rank(None)

    @property
    def dp_size(self) -> int:
        return group_size(None)

    @property
    def dp_group(self):
        return None

    def forward_backward_step(self, batch, ctx=None, forward_only=False, preprocess_fn=None, postprocess_fn=None):
        spec = StepSpec(config=self.config, dp_group=self.dp_group, forward=self._forward, vocab_size=self.module.head.out_features)
        return forward_backward_loop(spec, batch, self._loss_fn, self.deferred, ctx, forward_only, preprocess_fn, postprocess_fn)

    def _forward(self, mb: TensorDict) -> TensorDict:
        ids = mb["input_ids"]
        packed = pack(ids)
        if self.config.use_remove_padding:
            segments = torch.repeat_interleave(torch.arange(mb.batch_size[0]), packed.cu_seqlens.diff().long())
            logits = self.model(packed.input_ids[None], packed.position_ids[None], segments[None])[0]
        else:
            padded, mask = pad(ids)
            positions = torch.arange(padded.shape[1]).expand_as(padded)
            segments = torch.where(mask, torch.arange(padded.shape[0])[:, None], -1)
            logits = self.model(padded, positions, segments)[mask]  # back to packed order
        out = {"log_probs": unpack(token_log_probs(logits, packed.input_ids, packed.cu_seqlens), ids)}
        if mb.get_non_tensor("calculate_entropy", False):
            out["entropy"] = unpack(token_entropy(logits, packed.cu_seqlens), ids)
        return TensorDict(out, batch_size=mb.batch_size)

    def optimizer_zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.deferred.reset()

    def optimizer_step(self) -> float:
        # DDP already all-reduced the grads, so the norm is the same on every rank.
        deferred = self.deferred if self.config.deferred_normalization else None
        grad_norm = clip_and_step(
            list(self.module.parameters()), self.optimizer, self.config.optim.clip_grad, deferred, window=self.deferred
        )
        if math.isfinite(grad_norm):
            self.global_step += 1
        return grad_norm

    def lr_scheduler_step(self) -> float:
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]

    def to(self, device, model=True, optimizer=True) -> None:
        if model:
            self.module.to(device)
        if optimizer:
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = v.to(device)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        if hdfs_path is not None:
            raise NotImplementedError("the reference engine keeps local checkpoints only")
        if self.dp_rank == 0:
            path = os.path.join(local_path, f"global_step_{global_step}")
            os.makedirs(path, exist_ok=True)
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "global_step": global_step,
            }
            torch.save(state, os.path.join(path, "state.pt"))
            keep = max_ckpt_to_keep or self.config.checkpoint.max_ckpt_to_keep
            if keep:
                for old in _step_dirs(local_path)[:-keep]:
                    shutil.rmtree(old)
        if is_initialized():
            torch.distributed.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True) -> int:
        path = local_path if os.path.exists(os.path.join(local_path, "state.pt")) else _step_dirs(local_path)[-1]
        state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
        self.global_step = state["global_step"]
        return self.global_step

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.state_dict().items():
            yield name, param.detach().clone()


def _step_dirs(root: str) -> list[str]:
    steps = [d for d in os.listdir(root) if d.startswith("global_step_")]
    return [os.path.join(root, d) for d in sorted(steps, key=lambda d: int(d.rsplit("_", 1)[1]))]


def register() -> None:
    """Register :class:`ReferenceEngine` as ``reference`` (replacing an earlier registration)."""
    unregister_engine(NAME)
    register_engine(NAME)(ReferenceEngine)
