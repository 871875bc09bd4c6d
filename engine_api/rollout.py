"""The rollout-engine contract: ``BaseRollout``, the inference twin of ``BaseEngine``.

What RL needs from an inference engine, and nothing else:

* ``generate(prompts, params, seeds)``: token ids in, per prompt ``params.n`` samples out, each
  with its response ids, the sampled tokens' log-probs, why it ended, and the policy version
  of the weights that produced it;
* a versioned weight update in phases: ``begin_weight_update(version)``, any number of
  ``update_weights(chunk)`` (``(hf_name, tensor)`` pairs, e.g. one ``export_weights(bucket_mb=...)``
  bucket each), ``finish_weight_update()``; ``sync_weights(named, version, chunk_mb)`` drives them;
* LoRA adapters loaded or replaced by version (``load_adapter``), where the backend serves them;
* ``release_memory`` / ``resume_memory`` around training (vLLM sleep/wake on GPU; a recorded
  no-op where nothing can be freed) and ``shutdown``.

Conventions every backend follows (the rollout conformance kit checks them:
``python -m engine_api.conformance --rollout NAME``):

* **Log-probs.** ``log_probs[i]`` is the log-probability of ``token_ids[i]`` under the
  distribution it was sampled from: ``log_softmax`` of the logits divided by ``temperature``,
  restricted to the ``top_k`` / ``top_p`` set and renormalised (vLLM's ``processed_logprobs``).
  With ``top_k`` off and ``top_p = 1`` it is exactly what a trainer computes for that token
  with the same ``temperature`` metadata, so trainer and rollout log-probs agree at float noise
  in fp32; with a truncated set the gap is real and is what the actor's rollout correction
  (TIS / MIS) is for.
* **Seeds.** Sample ``j`` of prompt ``i`` depends only on the weights, the prompt, the
  sampling settings and ``sample_seed(seeds[i], j)``: not on which other prompts share the
  call, their order, or how many ranks split them (what makes a sharded rollout equal to a
  single-rank one).
* **Stops.** A response ends after a token of ``stop_token_ids`` (kept in the response), after
  the token that completes one of ``stop`` strings in its decoded text (kept; needs a
  tokenizer), or at ``max_tokens``. ``finish_reason`` is ``"stop"`` or ``"length"``.
* **Weight updates are atomic.** The base class stages a whole update: each chunk is checked
  as it arrives, before any of it is staged: names and shapes against the model's
  (``weight_shapes``), and each tensor's kind (a dense, plain ``torch.Tensor`` with data: not a
  meta, sparse or un-gathered ``DTensor`` one), dtype (floating point: an integer or bool tensor
  is refused, never cast into a weight) and values (finite). Only a complete update (every
  weight received) is applied, at ``finish_weight_update``, so a backend's apply never meets a
  tensor it cannot load. A refused chunk or an incomplete update leaves the previous weights
  and version in place, and the next update starts clean. Staging holds one copy
  of the incoming weights (the export yields fresh full tensors anyway); streaming into the
  engine per chunk would save that memory at the cost of atomicity.
* **Versions.** Every sample carries the ``weight_version`` of the weights that produced it:
  the ``version`` of the last applied update (or adapter load), 0 for the weights the engine
  was built with; ``token_versions`` says it per token (a continued sample spans several).
* **Partial rollouts (abort and resume).** ``generate(..., kept=...)`` continues unfinished
  samples of an earlier call, possibly under newer weights (asynchronous RL pauses generation
  at a token boundary, applies a weight update, and goes on): the kept tokens are fed back as
  part of the prompt, never re-sampled and never re-scored; only ``params.max_tokens`` new
  tokens are drawn, each with the log-prob and the version of the weights that drew it. The
  continuation draws from ``sample_seed(seed, RESUME_INDEX + len(kept tokens))``, so where the
  pause fell changes the draws only through the weights. Assumption: a stop string split
  across the pause boundary is not detected (the backend sees the kept tokens as prompt), as in
  vLLM-based abort-and-resume; stop token ids are never split.

Backends subclass ``BaseRollout``, implement the ``_``-prefixed hooks and register with
``@register_rollout("name")`` (``engine_api.rollout_registry``). This module imports no
inference library.
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

FINISH_REASONS = ("stop", "length")
# Sample indices from here on seed the continuations of partial rollouts (``generate(kept=...)``):
# far above any ``params.n``, so a continuation never reuses a fresh sample's stream.
RESUME_INDEX = 1 << 40


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a prompt whose seed is ``seed``: a 63-bit hash of both,
    so neighbouring seeds and indices give unrelated streams. Every backend derives its
    per-sample seeds here."""
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample.

    Attributes:
        n: samples per prompt.
        temperature: softmax temperature, > 0 (the trainer divides its logits by it, so greedy
            decoding, temperature 0, has no log-prob to agree with).
        top_p: nucleus mass in (0, 1]; 1 keeps the whole vocabulary.
        top_k: keep the k most likely tokens; -1: off.
        max_tokens: response length cap, >= 1.
        stop_token_ids: a response ends after sampling one of these (kept in the response).
        stop: a response ends after the token that completes one of these strings in its
            decoded text (kept); needs a backend with a tokenizer.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def _problems(self) -> list[str]:
        """Every bad setting, each naming the field, the value and the fix."""
        out = []
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            out.append(f"n = {self.n!r}: must be an integer >= 1; fix: e.g. 1")
        if not isinstance(self.temperature, (int, float)) or not (self.temperature > 0 and math.isfinite(self.temperature)):
            out.append(
                f"temperature = {self.temperature!r}: must be a finite number > 0 (the trainer's log-probs divide by it); fix: e.g. 1.0"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            out.append(f"top_p = {self.top_p!r}: must be in (0, 1]; fix: e.g. 1.0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            out.append(f"top_k = {self.top_k!r}: must be -1 (off) or >= 1; fix: e.g. -1")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            out.append(f"max_tokens = {self.max_tokens!r}: must be an integer >= 1; fix: e.g. 16")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            out.append(f"stop_token_ids = {self.stop_token_ids!r}: must be non-negative token ids; fix: e.g. (2,)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            out.append(f"stop = {self.stop!r}: must be non-empty strings; fix: drop the empty ones")
        return out


@dataclass(frozen=True)
class Sample:
    """One generated response.

    Attributes:
        token_ids: ``[R]`` int64 response ids (the prompt excluded).
        log_probs: ``[R]`` float32 log-probs of those ids (see the module docstring).
        finish_reason: ``"stop"`` or ``"length"``.
        weight_version: the version of the weights that produced it.
        routed_experts: only when the engine was built with ``return_routing`` (an MoE
            model): int64 ``[P + R, L, k]``, the experts each of the model's ``L`` MoE layers
            (in layer order) routed each token of prompt + response to (``k``: the model's
            top-k), in the engine's own top-k order; ``-1`` (``engine_api.moe.NOT_ROUTED``)
            for a token the engine never ran through the model (the last response token: no
            forward follows it). Row ``t`` is the routing of the hidden state at position
            ``t``, the one that predicts token ``t + 1``; a trainer replays it
            (``actor.router_replay=r3``). None otherwise. A continued sample keeps the rows
            its earlier weights routed (those forwards sampled its kept tokens).
        token_versions: ``[R]`` int64, the weight version that sampled each response token
            (a sample continued across a weight update spans several); None: every token
            ``weight_version``. ``weight_version`` is the newest of them.
    """

    token_ids: torch.Tensor
    log_probs: torch.Tensor
    finish_reason: str
    weight_version: int
    routed_experts: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None

    def versions(self) -> torch.Tensor:
        """``[R]`` int64: each response token's weight version."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full((len(self.token_ids),), int(self.weight_version), dtype=torch.long)


@dataclass(frozen=True)
class RolloutEngineConfig:
    """What every rollout backend is built from.

    Attributes:
        model_path: local HF model directory (``config.json`` + weights); the engine starts
            with these weights (version 0).
        tokenizer_path: directory with the tokenizer that decodes responses (stop strings);
            None: no tokenizer (token ids only).
        seed: engine-level seed (backends whose sampling needs one besides the per-sample seeds).
        max_model_len: longest prompt + response in tokens; None: the model's
            ``max_position_embeddings``.
        dtype: ``float32`` (parity in fp32 on CPU), ``bfloat16`` or ``float16``.
        lora_rank: > 0 serves LoRA adapters of up to this rank (``load_adapter``); 0: none.
        options: backend-specific settings (e.g. vLLM's ``gpu_memory_utilization``); each
            backend validates its own and refuses unknown keys.
        return_routing: record every sample's MoE routing (``Sample.routed_experts``); only a
            backend with ``supports_routing`` accepts it, for an MoE model.
    """

    model_path: str
    tokenizer_path: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    dtype: str = "float32"
    lora_rank: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    return_routing: bool = False


class BaseRollout(abc.ABC):
    """An inference engine serving one model for RL sampling (see the module docstring).

    Not collective: each instance serves the prompts given to it on its own process;
    ``roles.rollout.Rollout`` shards a step's prompts across ranks and gathers the results.
    """

    #: whether ``load_adapter`` serves LoRA adapters (adapter-only sync)
    supports_lora: ClassVar[bool] = False
    #: whether the engine can record MoE routing (``RolloutEngineConfig.return_routing``)
    supports_routing: ClassVar[bool] = False

    def __init__(self, config: RolloutEngineConfig) -> None:
        if config.return_routing and not self.supports_routing:
            raise ValueError(
                f"return_routing = True: the {type(self).__name__} backend records no MoE routing; fix: use a backend that does "
                "(hf; vllm on a GPU), or actor.router_replay=r2 / off"
            )
        self.config = config
        self._version = 0
        self._staged: dict[str, torch.Tensor] | None = None
        self._staging_version: int | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self.memory_released = False
        self.closed = False

    # ------------------------------------------------------------------ generation
    @property
    def weight_version(self) -> int:
        """The version of the weights that ``generate`` samples from now."""
        return self._version

    def generate(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        params: SamplingParams,
        seeds: Sequence[int],
        kept: Sequence[Sample | None] | None = None,
    ) -> list[list[Sample]]:
        """``params.n`` samples for each prompt (token ids), in order; sample ``j`` of prompt
        ``i`` is drawn with ``sample_seed(seeds[i], j)``.

        ``kept`` (partial rollouts; needs ``n = 1``): ``kept[i]``, when not None, is the
        unfinished sample of ``prompts[i]`` returned by an earlier call (``finish_reason``
        ``"length"``), maybe under older weights; it is continued by up to ``max_tokens`` new
        tokens from ``sample_seed(seeds[i], RESUME_INDEX + len(kept[i].token_ids))``, and the
        returned sample holds its kept tokens, log-probs, versions (and routing) unchanged,
        followed by the new ones (module docstring).

        Raises:
            ValueError: a bad sampling setting (naming the field), an empty prompt, a prompt
                (+ kept tokens) + ``max_tokens`` over ``max_model_len``, ``len(seeds) !=
                len(prompts)``, or a ``kept`` entry that is not an unfinished sample.
            RuntimeError: a weight update is open, the memory is released, or the engine is
                shut down.
        """
        problems = params._problems()
        if problems:
            raise ValueError("sampling params: " + "; ".join(problems))
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: {len(seeds)} given for {len(prompts)} prompts; fix: one seed per prompt")
        kept = _check_kept(kept, len(prompts), params.n)
        ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        seeds = [int(s) for s in seeds]
        for i, k in enumerate(kept):
            if k is not None:  # the kept tokens are fed as prompt: they are never re-sampled
                ids[i] = torch.cat([ids[i], k.token_ids.reshape(-1).long().cpu()])
                seeds[i] = sample_seed(seeds[i], RESUME_INDEX + len(k.token_ids))
        limit = self.max_model_len
        for i, p in enumerate(ids):
            if p.numel() == 0:
                raise ValueError(f"prompt {i} is empty; fix: give at least one token")
            if limit is not None and p.numel() + params.max_tokens > limit:
                raise ValueError(
                    f"prompt {i}: {p.numel()} tokens (kept response tokens included) + max_tokens {params.max_tokens} > max_model_len "
                    f"{limit}; fix: shorten the prompt (data.max_prompt_length / data.overlong) or lower the response length"
                )
        self._require_serving("generate")
        if not ids:
            return []
        out = self._generate(ids, params, seeds)
        if len(out) != len(ids) or any(len(group) != params.n for group in out):
            raise RuntimeError(f"{type(self).__name__}._generate returned the wrong number of samples; fix the backend")
        return [[_continued(k, g[0])] if k is not None else g for k, g in zip(kept, out, strict=True)]

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + response this engine accepts (None: unknown)."""
        return self.config.max_model_len

    # ------------------------------------------------------------------ before building
    @classmethod
    def model_problems(cls, config: RolloutEngineConfig) -> list[str]:
        """What makes ``config``'s model unusable by this backend, found from its files alone
        (no engine is built, nothing heavy is imported): each a line naming the value and the
        fix. Recipes call it at load, before the data and the training engines, so a refusal
        costs seconds, not a model build. Default: nothing; the engine's constructor stays the
        authority (it raises what this misses)."""
        return []

    @classmethod
    def fit_to_machine(cls, dtype: str, cuda: bool) -> tuple[str, int | None, str | None]:
        """What this backend needs of a run on this machine (``cuda``: CUDA is available here):
        ``(dtype, min_head_dim, why)``: the dtype to sample in instead of ``dtype`` (the same
        when it can), the narrowest attention head it runs (None: any), and why the dtype was
        changed (None: it was not). Recipes apply it to their rollout settings and to the tiny
        model they build. Default: ``dtype`` as asked, any head."""
        return dtype, None, None

    @classmethod
    def expected_max_model_len(cls, config: RolloutEngineConfig) -> int | None:
        """The ``max_model_len`` an engine built from ``config`` will have, from files alone
        (None: not known before building). Default: ``config.max_model_len``."""
        return config.max_model_len

    # ------------------------------------------------------------------ weight updates
    def begin_weight_update(self, version: int) -> None:
        """Open an update to weights ``version`` (an int, not below the current one: re-sending
        the same policy under its version is allowed)."""
        if self._staged is not None:
            raise RuntimeError("begin_weight_update: an update is already open; fix: finish_weight_update() or abort_weight_update() first")
        self._require_serving("begin_weight_update")
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise ValueError(f"version = {version!r}: must be an int >= the current weight version {self._version}; fix: count syncs up")
        if self._shapes is None:
            self._shapes = dict(self.weight_shapes())
        self._staged, self._staging_version = {}, version

    def update_weights(self, chunk: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage one chunk of ``(hf_name, tensor)`` pairs of the open update.

        Raises:
            RuntimeError: no update is open.
            ValueError: a name that is not a weight of the model or a shape that differs (the
                update is aborted: the previous weights and version stay).
        """
        if self._staged is None:
            raise RuntimeError("update_weights called without begin_weight_update; fix: open the update first")
        assert self._shapes is not None
        pairs = list(chunk)
        for name, tensor in pairs:
            want = self._shapes.get(name) if isinstance(tensor, torch.Tensor) else None
            if want is None or tuple(tensor.shape) != want:
                self.abort_weight_update()
                if not isinstance(tensor, torch.Tensor):
                    got, fix = f"is a {type(tensor).__name__}, not a tensor", "send (name, torch.Tensor) pairs"
                elif want is None:
                    got, fix = "is not a weight of the rollout model", "build the trainer and the rollout from the same HF model directory"
                else:
                    got = f"has shape {tuple(tensor.shape)}, the model {want}"
                    fix = "build the trainer and the rollout from the same HF model directory"
                raise ValueError(
                    f"weight update: {name!r} {got}; the update is refused and weights version {self._version} stay; fix: {fix}"
                )
            problem = unloadable(tensor)
            if problem is not None:
                self.abort_weight_update()
                raise ValueError(
                    f"weight update: {name!r} {problem[0]}; the update is refused and weights version {self._version} stay; "
                    f"fix: {problem[1]}"
                )
        for name, tensor in pairs:
            self._staged[name] = tensor.detach()

    def finish_weight_update(self) -> None:
        """Apply the staged update, if complete, and make its version current.

        Raises:
            RuntimeError: no update is open.
            ValueError: some weights were never received (the update is aborted; the previous
                weights and version stay).
        """
        if self._staged is None:
            raise RuntimeError("finish_weight_update called without begin_weight_update; fix: open the update first")
        assert self._shapes is not None
        optional = self.optional_weights()
        missing = [n for n in self._shapes if n not in self._staged and n not in optional]
        if missing:
            self.abort_weight_update()
            raise ValueError(
                f"weight update: {len(missing)} weight(s) never received, e.g. {missing[:3]}; the update is refused and weights "
                f"version {self._version} stay; fix: send every weight of export_weights()"
            )
        staged, version = self._staged, self._staging_version
        self._staged = self._staging_version = None
        self._apply_weights(staged)
        self._version = int(version)

    def abort_weight_update(self) -> None:
        """Drop an open update (nothing of it was applied)."""
        self._staged = self._staging_version = None

    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int, chunk_mb: float | None = 512.0) -> None:
        """The three phases over ``named``: chunks of about ``chunk_mb`` MB (None: one tensor each)."""
        self.begin_weight_update(version)
        try:
            for chunk in chunk_pairs(named, chunk_mb):
                self.update_weights(chunk)
        except BaseException:
            self.abort_weight_update()
            raise
        self.finish_weight_update()

    # ------------------------------------------------------------------ adapters, memory, life
    def load_adapter(self, adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any], version: int) -> None:
        """Serve the LoRA ``adapter`` (peft's saved names -> tensors; ``lora``: its ``r`` and
        ``lora_alpha``; the adapted modules are read off the names) on top of the base weights from now on, replacing
        the previous adapter; samples carry ``version``.

        Raises:
            NotImplementedError: the backend serves no adapters (``supports_lora`` False).
        """
        if not self.supports_lora:
            raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters; fix: sync merged weights instead")
        self._require_serving("load_adapter")
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise ValueError(f"version = {version!r}: must be an int >= the current weight version {self._version}; fix: count syncs up")
        if not adapter:
            raise ValueError("load_adapter: the adapter has no tensors; fix: export the LoRA engine's adapters")
        for name, tensor in adapter.items():
            problem = unloadable(tensor) if isinstance(tensor, torch.Tensor) else (f"is a {type(tensor).__name__}", "send tensors")
            if problem is not None:
                raise ValueError(
                    f"load_adapter: {name!r} {problem[0]}; the adapter is refused and weights version {self._version} stay; "
                    f"fix: {problem[1]}"
                )
        self._load_adapter(dict(adapter), dict(lora), version)
        self._version = version

    def unload_adapter(self, version: int) -> None:
        """Serve the engine's weights without an adapter from now on (after ``load_adapter``:
        the base weights, or what ``sync_weights`` loaded since); samples carry ``version``. A
        backend may keep earlier adapters cached, so loading one again is cheap (vLLM: up to
        ``max_loras`` resident). No-op for the adapter state when none is loaded.

        Raises:
            NotImplementedError: the backend serves no adapters (``supports_lora`` False).
        """
        if not self.supports_lora:
            raise NotImplementedError(f"{type(self).__name__} serves no LoRA adapters; nothing to unload")
        self._require_serving("unload_adapter")
        if isinstance(version, bool) or not isinstance(version, int) or version < self._version:
            raise ValueError(f"version = {version!r}: must be an int >= the current weight version {self._version}; fix: count syncs up")
        self._unload_adapter()
        self._version = version

    def prompt_log_probs(self, prompts: Sequence[Sequence[int] | torch.Tensor]) -> list[torch.Tensor]:
        """Per prompt, ``log p(prompt[i] | prompt[:i])`` for every ``i >= 1`` (``[len - 1]`` float32,
        temperature 1) under the weights served now: how well the policy predicts a given text
        (the Tinker API's ``compute_logprobs``). Generates nothing.

        Raises:
            NotImplementedError: the backend scores no prompts (the message names it).
            ValueError: an empty prompt, or one longer than ``max_model_len``.
        """
        self._require_serving("prompt_log_probs")
        ids = [torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in prompts]
        for i, p in enumerate(ids):
            if p.numel() == 0:
                raise ValueError(f"prompts[{i}] is empty; fix: give every prompt at least one token")
            if self.max_model_len is not None and p.numel() > self.max_model_len:
                raise ValueError(f"prompts[{i}] has {p.numel()} tokens, more than max_model_len = {self.max_model_len}; fix: shorten it")
        return [lp.to(torch.float32).cpu() for lp in self._prompt_log_probs(ids)]

    def release_memory(self) -> bool:
        """Free what the engine can between rollouts (weights and KV cache); ``generate`` is
        refused until ``resume_memory``. Returns whether anything was actually freed (False:
        a recorded no-op, e.g. vLLM on CPU)."""
        self._require_serving("release_memory")
        freed = self._release_memory()
        self.memory_released = True
        return freed

    def resume_memory(self) -> None:
        """Undo ``release_memory`` (a no-op when nothing is released)."""
        if self.memory_released:
            self._resume_memory()
            self.memory_released = False

    def shutdown(self) -> None:
        """Free the engine for good; idempotent."""
        if not self.closed:
            self.closed = True
            self._shutdown()

    def _require_serving(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"{what}: the rollout engine is shut down; fix: build a new one")
        if self.memory_released:
            raise RuntimeError(f"{what}: the rollout engine's memory is released; fix: call resume_memory() first")
        if self._staged is not None:
            raise RuntimeError(f"{what}: a weight update is open; fix: finish_weight_update() or abort_weight_update() first")

    # ------------------------------------------------------------------ backend hooks
    def weight_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """HF name -> shape of every weight an update may carry (default: the tensors of the
        model directory's safetensors files, plus a tied ``lm_head.weight``)."""
        return hf_weight_shapes(self.config.model_path)[0]

    def optional_weights(self) -> set[str]:
        """Names an update may carry but need not (default: a tied ``lm_head.weight``)."""
        return hf_weight_shapes(self.config.model_path)[1]

    @abc.abstractmethod
    def _generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int]) -> list[list[Sample]]:
        """``generate`` after validation."""

    @abc.abstractmethod
    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load a complete, checked set of weights (HF names) into the engine."""

    def _load_adapter(self, adapter: dict[str, torch.Tensor], lora: dict[str, Any], version: int) -> None:
        raise NotImplementedError

    def _unload_adapter(self) -> None:
        """Stop applying the current adapter (a backend with ``supports_lora``)."""
        raise NotImplementedError

    def _prompt_log_probs(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``prompt_log_probs`` after validation (default: not offered)."""
        raise NotImplementedError(f"the {type(self).__name__} rollout backend scores no prompts; fix: a backend that does (hf, vllm)")

    def _release_memory(self) -> bool:
        return False

    def _resume_memory(self) -> None:
        return None

    def _shutdown(self) -> None:
        return None


def _check_kept(kept: Sequence[Sample | None] | None, prompts: int, n: int) -> list[Sample | None]:
    """``kept`` as a list of one entry per prompt, each checked (``generate``'s ``kept``)."""
    if kept is None:
        return [None] * prompts
    kept = list(kept)
    if len(kept) != prompts:
        raise ValueError(f"kept: {len(kept)} entries for {prompts} prompts; fix: one (a Sample or None) per prompt")
    if n != 1 and any(k is not None for k in kept):
        raise ValueError(f"n = {n}: continuing kept samples needs n = 1; fix: one request per sample")
    for i, k in enumerate(kept):
        if k is None:
            continue
        if not isinstance(k, Sample):
            raise ValueError(f"kept[{i}] is a {type(k).__name__}; fix: pass the Sample an earlier generate returned, or None")
        if k.finish_reason != "length":
            raise ValueError(f"kept[{i}] has finish_reason {k.finish_reason!r}: it is finished; fix: continue only samples cut at length")
        if (
            k.token_ids.dim() != 1
            or len(k.token_ids) == 0
            or k.log_probs.shape != k.token_ids.shape
            or k.versions().shape != k.token_ids.shape
        ):
            raise ValueError(
                f"kept[{i}]: token_ids, log_probs and token_versions must be 1-D of one length >= 1; fix: pass the Sample as returned"
            )
    return kept


def _continued(kept: Sample, new: Sample) -> Sample:
    """``kept`` followed by ``new`` (its continuation): tokens, log-probs and versions as each
    part was sampled. Routing: the kept rows that sampled the kept tokens (all but the last,
    which no forward of the earlier call fed), then the continuation's rows from the last kept
    token on (its forward under the new weights sampled the first new token)."""
    routed = None
    if kept.routed_experts is not None and new.routed_experts is not None:
        cut = new.routed_experts.shape[0] - len(new.token_ids) - 1  # prompt + kept tokens - 1
        routed = torch.cat([kept.routed_experts[:cut], new.routed_experts[cut:]])
    return Sample(
        token_ids=torch.cat([kept.token_ids.cpu(), new.token_ids.cpu()]),
        log_probs=torch.cat([kept.log_probs.float().cpu(), new.log_probs.float().cpu()]),
        finish_reason=new.finish_reason,
        weight_version=int(new.weight_version),
        routed_experts=routed,
        token_versions=torch.cat([kept.versions(), new.versions()]),
    )


def unloadable(tensor: torch.Tensor) -> tuple[str, str] | None:
    """Why ``tensor`` cannot be loaded into a model's weight, with the fix, or None.

    A weight must be a plain dense tensor with data (not a ``DTensor`` shard, whose shape is the
    global one while it holds only the local part; not meta, not sparse), of a floating-point
    dtype (a cast of int64 / bool values into a float weight is never what was meant; any
    float dtype is fine, the engine casts fp32 to bf16 as usual), and finite (NaN / inf
    weights make every log-prob NaN while generation goes on)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        return (
            f"is a {type(tensor).__name__} (e.g. an un-gathered DTensor shard), not a plain tensor",
            "send full tensors (DTensor.full_tensor(), or the engine's export_weights())",
        )
    if tensor.is_meta:
        return "is on the meta device (it holds no data)", "materialise the weights before sending them (export_weights())"
    if tensor.layout != torch.strided:
        return f"has layout {tensor.layout}, not dense", "send dense tensors (.to_dense())"
    if not tensor.is_floating_point():
        return (
            f"has dtype {tensor.dtype}, not a floating-point one (it would be cast silently)",
            "send the trainer's floating-point weights; an integer or bool tensor is not a weight",
        )
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        return f"has {bad} non-finite value(s) (NaN / inf)", "find where the trainer's weights went non-finite; do not sync them"
    return None


def chunk_pairs(named: Iterable[tuple[str, torch.Tensor]], chunk_mb: float | None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs into lists of about ``chunk_mb`` MB (None: one pair each)."""
    limit = None if chunk_mb is None else max(1, int(chunk_mb * 2**20))
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        chunk.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if limit is None or size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def hf_weight_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """``(shapes, optional)`` of an HF model directory: name -> shape of every tensor in its
    ``*.safetensors`` files, read from their JSON headers (no tensor is loaded, nothing is
    unpickled), plus ``lm_head.weight`` when ``config.json`` ties it to ``embed_tokens`` (an
    export may carry it, a checkpoint does not); ``optional`` names the latter."""
    import json
    import os
    import struct

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model_path = {model_path!r} has no *.safetensors files; fix: save the model with save_pretrained")
    for name in files:
        with open(os.path.join(model_path, name), "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, meta in header.items():
            if key != "__metadata__":
                shapes[key] = tuple(meta["shape"])
    optional: set[str] = set()
    with open(os.path.join(model_path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    embed = next((k for k in shapes if k.endswith("embed_tokens.weight")), None)
    if tied and embed is not None and "lm_head.weight" not in shapes:
        shapes["lm_head.weight"] = shapes[embed]
        optional.add("lm_head.weight")
    return shapes, optional
