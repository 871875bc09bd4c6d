"""A reference engine: torch DDP over an HF model, written on the backend kit only.

It is the worked example of ``docs/adding-a-backend.md``: a third backend in ~200 lines that
imports nothing from ``backends/`` and only ``engine_api.kit`` from the engine layer, and
that passes the conformance kit (``python -m engine_api.conformance tests.reference_engine:ReferenceEngine``).
Tests register it as ``reference`` (:func:`register`); it also works by import path.

Design: the whole HF model on every rank, torch ``DistributedDataParallel`` (gradients
averaged over the world, which the shared loop compensates), AdamW, packed micro-batches as one
row with per-sequence positions (HF starts a new sequence where positions restart) or padded
rows with an attention mask. Checkpoints: rank 0 writes the model and optimizer state as plain
tensors (``weights_only`` loadable), each rank its scheduler / RNG / step, inside the shared
directory protocol (manifest, marker, ``latest``, retention, remote copy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
from tensordict import TensorDict
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from engine_api import kit

NAME = "reference"
BACKEND = "reference-ddp"  # recorded in the checkpoint marker


@dataclass(frozen=True)
class ReferenceOptions(kit.BackendOptions):
    """The ``reference.*`` section: torch DDP settings.

    Attributes:
        bucket_cap_mb: DDP gradient bucket size.
    """

    config_section: ClassVar[str] = "reference"

    bucket_cap_mb: int = 25

    def _problems(self) -> list[str]:
        if self.bucket_cap_mb < 1:
            return [kit.format_problem("bucket_cap_mb", self.bucket_cap_mb, "must be positive", "e.g. 25")]
        return []


class ReferenceEngine(kit.BaseEngine):
    """BaseEngine over an HF model with torch DDP over the default group."""

    options_class = ReferenceOptions

    @classmethod
    def check_config(cls, config) -> list[str]:
        """The reference computes in fp32 only (no mixed-precision policy) and compiles nothing:
        another ``model.dtype`` or ``compile=true`` is refused here, not silently ignored."""
        out = []
        if config.model.dtype != "float32":
            out.append(
                kit.format_problem("model.dtype", config.model.dtype, "the reference engine computes in fp32 only", "model.dtype=float32")
            )
        if config.compile:
            out.append(kit.format_problem("compile", True, "the reference engine does not compile its model", "compile=false"))
        return out

    def _build_model(self) -> None:
        """Join or create the process group, load the HF model, wrap it in DDP, build AdamW + LR."""
        cfg = self.config
        if cfg.model.path is None:
            raise ValueError("model.path = None: the reference engine loads an HF directory; fix: set engine.model.path")
        self.device = kit.compute_device()
        kit.ensure_process_group("nccl" if self.device.type == "cuda" else "gloo", cfg.dist_timeout_s)
        torch.manual_seed(cfg.seed)  # seeds a value head the same way on every rank
        if cfg.model.head == "value":
            hf = AutoConfig.from_pretrained(cfg.model.path, num_labels=1)
            hf.classifier_dropout = 0.0
            self.module = AutoModelForTokenClassification.from_pretrained(cfg.model.path, config=hf, dtype=torch.float32)
            if not cfg.model.value_bias:  # HF sequence classification's head: the same weight, no bias
                self.module.score = self._bias_free(self.module.score)
        else:
            self.module = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
        self.module.requires_grad_(not cfg.frozen)
        self.module.to(self.device)
        options = kit.options_of(cfg, ReferenceOptions)
        self.model = (
            nn.parallel.DistributedDataParallel(self.module, bucket_cap_mb=options.bucket_cap_mb)
            if self.dp_size > 1 and not cfg.frozen
            else self.module
        )
        self.optimizer = None if cfg.frozen else kit.build_adamw(self.module.parameters(), cfg.optim)
        self.scheduler = None if cfg.frozen else kit.build_lr_scheduler(self.optimizer, cfg.optim)

    @staticmethod
    def _bias_free(score: nn.Linear) -> nn.Linear:
        head = nn.Linear(score.in_features, score.out_features, bias=False)
        with torch.no_grad():
            head.weight.copy_(score.weight)
        return head

    def _modules(self):
        # BaseEngine switches modes, offloads (by copying) and steps the optimizer over these.
        return [self.module]

    @property
    def dp_rank(self) -> int:
        return kit.group_rank(None)

    @property
    def dp_size(self) -> int:
        return kit.group_size(None)

    @property
    def dp_group(self):
        return None

    # ------------------------------------------------------------------ compute
    def _step_spec(self) -> kit.StepSpec:
        """What the shared loop needs: DDP averages gradients over DP (the loop compensates)."""
        hf = self.module.config
        return kit.StepSpec(
            config=self.config,
            dp_group=self.dp_group,
            forward=self._forward,
            device=self.device,
            vocab_size=hf.vocab_size,
            grads_averaged_over_dp=True,
            max_positions=getattr(hf, "max_position_embeddings", None),
        )

    def _forward(self, mb: TensorDict) -> TensorDict:
        ids = mb["input_ids"]
        packed = kit.pack(ids)
        if self.config.use_remove_padding:
            logits = self.model(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False).logits[0]
        else:
            padded, mask = kit.pad(ids)
            logits = self.model(input_ids=padded, attention_mask=mask.long(), use_cache=False).logits[mask]
        if self.config.model.head == "value":
            values = kit.align_to_tokens(logits[:-1, 0].float(), packed.cu_seqlens)
            return TensorDict({"values": kit.unpack(values, ids)}, batch_size=mb.batch_size)
        logits = logits / kit.temperature_of(mb)
        # log_probs, entropy when asked, target_log_probs when the batch has target_ids
        out = kit.lm_token_outputs(logits, packed.input_ids, packed.cu_seqlens, mb)
        return TensorDict({k: kit.unpack(v, ids) for k, v in out.items()}, batch_size=mb.batch_size)

    # ------------------------------------------------------------------ state
    def _save_checkpoint(self, local_path, hdfs_path, global_step, keep, extra) -> None:
        tmp = kit.ckpt_layout.begin(local_path, global_step)
        if self.dp_rank == 0:  # every rank holds the same replica
            for name, state in (("model.pt", self.module.state_dict()), ("optim.pt", self.optimizer.state_dict())):
                with open(os.path.join(tmp, name), "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
        kit.ckpt_layout.save_extra(tmp, extra)
        kit.ckpt_layout.commit(local_path, global_step, keep, hdfs_path, {"backend": BACKEND})

    def _load_checkpoint(self, local_path, hdfs_path, del_local_after_load) -> dict:
        path, downloaded, info = kit.ckpt_layout.open_checkpoint(
            local_path, hdfs_path, not del_local_after_load, self.config.checkpoint.verify
        )
        if info.get("backend") != BACKEND:
            kit.ckpt_layout.finish_load(downloaded)
            raise ValueError(f"checkpoint {path} was written by backend {info.get('backend')!r}; fix: load it with that engine.strategy")
        with kit.ckpt_layout.reading(path):
            model_sd = torch.load(os.path.join(path, "model.pt"), map_location="cpu", weights_only=True)
            optim_sd = torch.load(os.path.join(path, "optim.pt"), map_location="cpu", weights_only=True)
            extra = kit.ckpt_layout.load_extra(path, info)
        kit.ckpt_layout.finish_load(downloaded)
        # Everything is read and verified: only now does engine state change.
        self.module.load_state_dict(model_sd)
        self.optimizer.load_state_dict(optim_sd)
        return extra

    def _export_weights(self, bucket_bytes):
        del bucket_bytes  # unsharded: nothing to gather, so the transfer hint changes nothing
        for name, param in self.module.state_dict().items():
            yield name, param.detach().clone()
        if dist.is_initialized():
            kit.barrier(None)


def register() -> None:
    """Register :class:`ReferenceEngine` as ``reference`` (replacing an earlier registration)."""
    kit.unregister_engine(NAME)
    kit.register_engine(NAME)(ReferenceEngine)
