"""``BaseEngine``: the contract every backend implements (docs/design.md, section 2): public
template methods that do the contract's bookkeeping once, over small backend hooks."""

from __future__ import annotations

import abc
import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from engine_api.batch import shard_batch, unshard_batch
from engine_api.ckpt_layout import apply_extra, make_extra
from engine_api.config import EngineConfig
from engine_api.losses import DeferredNormalizer, LossFn
from engine_api.offload import Offloader, relocate_module, relocate_state
from engine_api.optim import NonFiniteUpdateError, agree_to_skip, check_update_finite
from engine_api.run_state import RunOwned, RunState
from engine_api.run_state import capture as capture_run_state
from engine_api.run_state import restore as restore_run_state
from engine_api.step import RETURN_PREDICTIONS, StepSpec, forward_backward_loop

PreprocessFn = Callable[[TensorDict, dict], TensorDict]
PostprocessFn = Callable[[TensorDict, TensorDict, dict], TensorDict]


def bucket_bytes(bucket_mb: float | None) -> int | None:
    """``export_weights``'s ``bucket_mb`` in bytes (``None`` stays ``None``).

    Raises:
        ValueError: ``bucket_mb`` is not a positive number.
    """
    if bucket_mb is None:
        return None
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or not bucket_mb > 0 or math.isinf(bucket_mb):
        raise ValueError(
            f"export_weights(bucket_mb={bucket_mb!r}): must be a finite number > 0 of MB; fix: e.g. 512, or None for one tensor at a time"
        )
    return max(1, int(bucket_mb * 2**20))


class BaseEngine(abc.ABC):
    """A training engine: one model (+ optimizer) on a set of ranks, driven by batches.

    Lifecycle: ``engine = build_engine(config)`` (cheap), ``engine.init_model()``, then
    ``with engine.train_mode(): engine.train_batch(batch)`` or
    ``with engine.eval_mode(): engine.infer_batch(batch)``. Batches follow ``engine_api.batch``
    (jagged TensorDicts); ``forward_backward_step`` takes this rank's DP shard
    (:meth:`shard_data`) and returns per-token jagged fields aligned with ``input_ids`` in the
    caller's row order. Bad input raises ``ValueError`` before any state changes, on every rank
    (validation is agreed). Every collective says so; all ranks must call it together.

    **The public methods are templates** that do the bookkeeping once for every backend: the
    frozen guard (``config.frozen``: training, saving and loading refused), the broken guard (a
    step wrote non-finite weights: training, saving and exporting refused until a load), the
    offloaded guard, loading on entering a mode and offloading by ``config.offload`` on leaving
    it (one :class:`~engine_api.offload.Offloader`, also for saving, loading and exporting), the
    deferred window (``self.deferred``), ``self.global_step``, the one optimizer-step skeleton
    (finish grads, deferred scale, global norm, a skip agreed by every rank, clip, update, the
    post-step finite check) and the LR scheduler.

    **A backend fills in the hooks** (the ``_``-prefixed methods; ``docs/adding-a-backend.md``
    has the table, ``engine_api.kit`` the pieces, ``python -m engine_api.conformance`` checks the
    results). Its duties:

    * settings: :attr:`options_class`, read with ``kit.options_of``; what only the backend can
      see comes from :meth:`check_config`, so ``build_engine`` refuses it before any build;
    * :meth:`_build_model`: join the launcher's world, or a 1-rank group for plain python
      (``kit.ensure_process_group``); set ``self.device``, the model, and unless frozen
      ``self.optimizer`` and ``self.scheduler`` (frozen: no optimizer, no gradient memory);
    * outputs (the forward :meth:`_step_spec` names): ``log_probs[i]`` = log p(token i | tokens
      < i), 0 at position 0, of the logits divided by the metadata ``temperature``; ``entropy``
      (same alignment) only when ``calculate_entropy``; ``model.head: value`` gives ``values[i]``
      from the prefix before token i, the new head seeded by ``config.seed`` on every rank;
    * the update does not depend on micro-batching, dynamic batching, packing, splitting over
      calls or the DP size: the shared loop (the default :meth:`_forward_backward`) ensures it
      when ``StepSpec.grads_averaged_over_dp`` says how gradients reduce;
    * offload (:meth:`_move`) releases the loaded storage and keeps a host copy, on a CPU-only
      machine too (:meth:`state_tensors` is where the kit looks); training with offload is
      bit-identical to training without;
    * checkpoints in the ``ckpt_layout`` protocol: manifest verified before anything is
      unpickled, tensors read with ``weights_only``, state changed only after everything is
      read, another backend's checkpoint refused; resume in a fresh process is bit-exact;
    * :meth:`_export_weights`: every weight by its HF name, in HF layout;
    * LoRA (only with :attr:`supports_lora`): only the adapters trained and checkpointed;
      metadata ``disable_adapters`` selects the base weights in a forward-only call; export
      merged weights, and the adapters alone (:meth:`_export_adapter_weights`);
    * what a training run owns on the engine, for :meth:`run_state` / :meth:`load_run_state`,
      is declared in one place, :meth:`_run_owned_state` (from the hooks it reads, and
      :attr:`run_state_attributes` for plain attributes): state a backend adds per run goes there.
    """

    #: The backend's own settings: a frozen dataclass with a ``config_section: ClassVar[str]``
    #: naming the engine-config section that holds them (``megatron.*``); ``build_engine``
    #: gives the engine ``config.backend`` as an instance of it. None: no settings.
    options_class: ClassVar[type | None] = None
    #: Whether the backend implements ``model.lora`` (see the LoRA duty above).
    supports_lora: ClassVar[bool] = False
    #: The engine attributes a training run owns besides its tensors (:meth:`_run_owned_state`):
    #: the optimizer-step counter, the deferred-normalization window, the clipping norm in force
    #: (``set_optim_hparams``) and the broken flag. ``run_state`` copies them, ``load_run_state``
    #: sets them back. A backend that keeps more per-run bookkeeping on the engine appends its names.
    run_state_attributes: ClassVar[tuple[str, ...]] = ("global_step", "deferred", "_clip_grad", "_broken")

    def __init__(self, config: EngineConfig) -> None:
        """Store the typed config; build nothing heavy (no model, no process groups)."""
        self.config = config
        self.device: torch.device = torch.device("cpu")  # the compute device, set by _build_model
        self.optimizer = None  # set by _build_model unless frozen
        self.scheduler = None
        self.global_step = 0
        self.deferred = DeferredNormalizer(config.loss_agg_mode, config.loss_agg_constant)
        self._loss_fn: LossFn | None = None
        # Why the weights are invalid (an optimizer step wrote NaN/inf into them), else None.
        self._broken: str | None = None
        # set_optim_hparams: the clipping norm in force (None: none) and which param groups decay.
        self._clip_grad: float | None = config.optim.clip_grad
        self._decaying_groups: list[bool] | None = None
        self._offloader = Offloader(self._move)

    # ================================================================== the contract
    @classmethod
    def check_config(cls, config: EngineConfig) -> list[str]:
        """Problems of ``config`` that only this backend knows about (layouts the model's
        shape cannot take, features it does not support), found without building anything.

        ``build_engine`` reports them together with the general config problems, so a bad
        config fails there and not in ``init_model`` or mid-run. Each string names the field,
        the value and the fix. The config may have general problems too: be defensive.
        Default: none.
        """
        return []

    def init_model(self) -> None:
        """Build/load the model from ``config.model.path``, the optimizer and LR scheduler
        (none for a frozen engine), then apply the offload policy. Collective."""
        self._build_model()
        if not self.config.frozen:
            # Which groups decay is fixed by the optimizer as built (a no-decay group for biases
            # and norms, where a backend makes one): recorded now, before a load could bring in
            # a step's weight decay of 0 and make every group look like a no-decay one.
            self._decaying_groups = self._build_decaying_groups()
        self._offloader.offload(model=self.config.offload.param, optimizer=self.config.offload.optimizer)

    def _build_decaying_groups(self) -> list[bool]:
        decays = self.config.optim.weight_decay > 0
        return [g.get("weight_decay", 0.0) > 0 or not decays for g in self._param_groups()]

    def train_mode(self) -> contextlib.AbstractContextManager[BaseEngine]:
        """Context manager for training: on enter, params, grads and optimizer state are on
        the compute device and the modules are in ``train()``; on exit, what
        ``config.offload`` names goes back to the CPU. Refused on a frozen or broken engine."""
        return self._mode(training=True)

    def eval_mode(self) -> contextlib.AbstractContextManager[BaseEngine]:
        """Context manager for inference: on enter, params are on the compute device and the
        modules are in ``eval()``; on exit, offloaded per ``config.offload``."""
        return self._mode(training=False)

    @contextlib.contextmanager
    def _mode(self, training: bool) -> Iterator[BaseEngine]:
        if training:
            self._refuse_if_frozen("train_mode")
            self._refuse_if_broken("train_mode")
        self._offloader.load(model=True, optimizer=training)
        for module in self._modules():
            module.train(training)
        try:
            yield self
        finally:
            self._offloader.offload(model=self.config.offload.param, optimizer=self.config.offload.optimizer)

    def set_loss_fn(self, loss_fn: LossFn) -> None:
        """Set the loss used by :meth:`forward_backward_step` (see ``engine_api.losses.LossFn``)."""
        self._loss_fn = loss_fn

    def forward_backward_step(
        self,
        batch: TensorDict,
        ctx: dict | None = None,
        forward_only: bool = False,
        preprocess_fn: PreprocessFn | None = None,
        postprocess_fn: PostprocessFn | None = None,
    ) -> tuple[TensorDict, dict] | tuple[TensorDict, float, dict]:
        """Run forward (and backward) over ``batch``, split into micro-batches by the config.

        Args:
            batch: this rank's shard of the global batch.
            ctx: a dict passed to the hooks and returned, with ``ctx["norm"]`` (the call's
                ``NormContext``, training) and ``ctx["metrics"]`` (per key, one value per
                micro-batch; for a metric the loss function declares summed, one value: the
                call's global sum, ``engine_api.losses.LossFn``); ``ctx[RETURN_PREDICTIONS] = False`` lets a training call return
                None for the predictions (``train_batch`` does this).
            forward_only: no backward, no loss; gradients untouched.
            preprocess_fn: ``fn(micro_batch, ctx) -> micro_batch`` before each forward.
            postprocess_fn: ``fn(micro_batch, outputs, ctx) -> outputs`` after each forward,
                before the loss.

        Returns:
            ``(predictions, ctx)`` if ``forward_only`` else ``(predictions, loss, ctx)``:
            ``predictions`` is a TensorDict of this rank's rows in ``batch``'s order (None
            where :attr:`is_output_rank` is False); ``loss`` is the call's global loss, the
            same float on every rank. Collective.

        Raises:
            ValueError: a malformed batch, or no loss function set for a training call;
                raised before any gradient is touched.
            RuntimeError: a training call on a frozen engine, or the model is offloaded.
        """
        if not forward_only:
            self._refuse_if_frozen("forward_backward_step(forward_only=False)")
        self._offloader.require_loaded(model=True, optimizer=False)
        return self._forward_backward(batch, ctx, forward_only, preprocess_fn, postprocess_fn)

    def optimizer_zero_grad(self) -> None:
        """Clear gradients and the accumulation window. Between ``forward_backward_step`` calls it
        aborts the window without a trace (the next window equals one on an engine that never
        saw the aborted data); also the recovery after a call that raised part-way. Refused
        while the model or the optimizer is :attr:`offloaded` (call it inside ``train_mode``)."""
        self._refuse_if_frozen("optimizer_zero_grad")
        self._offloader.require_loaded(model=True, optimizer=True)
        self._zero_grad()
        self.deferred.reset()

    def optimizer_step(self) -> float:
        """Finish the gradient sync, apply deferred normalization, clip, and step.

        Returns:
            The global pre-clip gradient norm (the same on every rank). If it, or a loss of the
            window, is not finite on *any* rank, every rank skips the step (agreed over the
            world: model-parallel peers compute the loss separately): state untouched, window
            reset, and a non-finite value returned (NaN when only a loss was). Collective.

        Raises:
            engine_api.optim.NonFiniteUpdateError: the step ran and left a parameter NaN or inf
                (on every rank); the engine refuses to train, save or export until a load.
        """
        self._refuse_if_frozen("optimizer_step")
        self._offloader.require_loaded(model=True, optimizer=True)
        self._finish_grads()
        nonfinite_loss = self.deferred.nonfinite_loss
        if self.config.deferred_normalization:
            self._scale_grads(self.deferred.grad_scale())
        self.deferred.reset()  # the next window starts clean, whether this step runs or not
        measured = self._grad_norm()
        # Sharded grads give a partial norm; full_tensor() all-reduces it into the global one.
        norm = float(measured.full_tensor() if isinstance(measured, DTensor) else measured)
        if agree_to_skip(norm, nonfinite_loss, None):
            return norm if not math.isfinite(norm) else math.nan  # non-finite either way: callers test it
        if self._clip_grad is not None:
            self._clip_grads(self._clip_grad, measured)
        self._apply_update()
        self._check_update(self._updated_parameters())
        self.global_step += 1
        return norm

    def set_optim_hparams(
        self,
        *,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        clip_grad: float | None | str = "keep",
    ) -> None:
        """Set AdamW's hyperparameters for the next optimizer steps (per-step control, as the
        Tinker API's ``optim_step(AdamParams)`` needs). ``None`` (``"keep"`` for ``clip_grad``)
        leaves a value as it is; ``clip_grad=None`` turns clipping off.

        They apply to every parameter group alike, except that a group built without weight
        decay (a backend's no-decay group, e.g. biases and norms where it makes them) keeps
        none. ``lr`` holds until the next ``lr_scheduler_step``, which sets the schedule's own
        learning rate: a caller that sets the rate every step does not step the scheduler.
        The values live in the optimizer's param groups, so a checkpoint saves them. Every
        value is checked first: a bad one raises ``ValueError`` naming it, and nothing changes.
        """
        self._refuse_if_frozen("set_optim_hparams")
        checks = [
            ("lr", lr, lr is None or (math.isfinite(lr) and lr >= 0), "a finite number >= 0"),
            ("eps", eps, eps is None or (math.isfinite(eps) and eps > 0), "a finite number > 0"),
            (
                "weight_decay",
                weight_decay,
                weight_decay is None or (math.isfinite(weight_decay) and weight_decay >= 0),
                "a finite number >= 0",
            ),
            (
                "betas",
                betas,
                betas is None or (len(tuple(betas)) == 2 and all(math.isfinite(b) and 0.0 <= b < 1.0 for b in betas)),
                "two numbers in [0, 1)",
            ),
            (
                "clip_grad",
                clip_grad,
                clip_grad in ("keep", None) or (math.isfinite(clip_grad) and clip_grad > 0),
                "a number > 0, or None for no clipping",
            ),
        ]
        for name, value, ok, want in checks:
            if not ok:
                raise ValueError(f"set_optim_hparams({name}={value!r}): must be {want}; nothing was changed")
        groups = self._param_groups()
        if self._decaying_groups is None or len(self._decaying_groups) != len(groups):
            # (recorded at init_model; a backend that rebuilt its groups since: from the config again)
            self._decaying_groups = self._build_decaying_groups()
        for group, decaying in zip(groups, self._decaying_groups, strict=True):
            if lr is not None:
                group["lr"] = float(lr)
            if betas is not None:
                group["betas"] = (float(betas[0]), float(betas[1]))
            if eps is not None:
                group["eps"] = float(eps)
            if weight_decay is not None:
                group["weight_decay"] = float(weight_decay) if decaying else 0.0
        if clip_grad != "keep":
            self._clip_grad = None if clip_grad is None else float(clip_grad)

    def reset_optimizer_state(self) -> None:
        """Restart the optimizer from the current weights: every tensor of its per-parameter
        state (AdamW's moments and step count) zeroed in place, and a step count a parameter
        group keeps (fused Adam implementations) set to 0, so the next ``optimizer_step`` is a
        first step, as on a new engine with these weights. Hyperparameters and the LR schedule
        stay. In place rather than cleared, so a checkpoint saved before the next step still has
        the state a load needs. Refused on a frozen engine and while the optimizer is
        :attr:`offloaded` (call it inside ``train_mode``). A backend whose optimizer is not a
        torch optimizer names its torch optimizers in :meth:`_torch_optimizers`."""
        self._refuse_if_frozen("reset_optimizer_state")
        self._offloader.require_loaded(model=False, optimizer=True)
        for opt in self._torch_optimizers():
            for group in opt.param_groups:
                if "step" in group and not isinstance(group["step"], torch.Tensor):
                    group["step"] = 0
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
                    elif key == "step":
                        state[key] = 0

    def lr_scheduler_step(self) -> float:
        """Advance the LR scheduler by one step and return the new learning rate."""
        self._refuse_if_frozen("lr_scheduler_step")
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ data parallel
    @property
    @abc.abstractmethod
    def dp_rank(self) -> int:
        """This rank's index in the data-parallel group."""

    @property
    @abc.abstractmethod
    def dp_size(self) -> int:
        """Number of data-parallel replicas."""

    @property
    @abc.abstractmethod
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel process group (None: the default group, or no distributed run)."""

    @property
    def is_moe(self) -> bool:
        """Whether the model routes tokens to experts (its step has a routing recorder):
        batches may then ask for routing replay and recording (``engine_api.moe``)."""
        return self._step_spec().router is not None

    @property
    def trains_with_dropout(self) -> bool:
        """Whether a training-mode forward may drop activations, so that it differs from the
        eval-mode forward of the same weights: a dropout with p > 0 anywhere in the model
        (``nn.Dropout`` modules, and the probabilities HF attention and megatron keep as module
        attributes or in the module's ``config``). Conservative: any attribute or config field
        named ``*dropout*`` or ``*pdrop*`` holding a positive number counts."""
        seen: set[int] = set()
        for root in self._modules():
            for module in root.modules():
                if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
                    return True
                if _positive_dropout(vars(module)):
                    return True
                config = getattr(module, "config", None)
                if config is not None and id(config) not in seen and hasattr(config, "__dict__"):
                    seen.add(id(config))
                    if _positive_dropout(vars(config)):
                        return True
        return False

    @property
    def is_output_rank(self) -> bool:
        """Whether :meth:`forward_backward_step` returns predictions on this rank. True by
        default; a pipeline-parallel backend may return them only where they are produced
        unless it broadcasts them."""
        return True

    def shard_data(self, data: TensorDict) -> TensorDict:
        """This rank's DP shard of a global batch: contiguous, equal-sized; model-parallel
        peers of one DP rank get the same shard.

        Raises:
            ValueError: the global batch size is not a multiple of :attr:`dp_size`.
        """
        return shard_batch(data, self.dp_rank, self.dp_size)

    def unshard_data(self, data: TensorDict) -> TensorDict:
        """Gather per-rank outputs (each rank's :meth:`shard_data` rows) back into the global
        batch in its original order, on every rank. Collective over :attr:`dp_group`."""
        return unshard_batch(data, self.dp_group)

    # ------------------------------------------------------------------ placement
    @property
    def offloaded(self) -> dict[str, bool]:
        """Which parts are offloaded now, ``{"model": bool, "optimizer": bool}``: the engine's
        record (``engine_api.offload``), the same on CPU-only and GPU machines."""
        return self._offloader.offloaded

    @property
    def placement(self) -> dict[str, torch.device]:
        """Where each part lives: the CPU while :attr:`offloaded`, else the compute device."""
        return {kind: torch.device("cpu") if off else torch.device(self.device) for kind, off in self.offloaded.items()}

    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True) -> None:
        """Load (the compute device; on a CPU-only machine that is ``"cpu"``) or offload (the
        CPU) the model and/or the optimizer state by hand; another device raises ``ValueError``."""
        self._offloader.to(device, self.device, model=model, optimizer=optimizer)

    def state_tensors(self, kind: str) -> Iterator[torch.Tensor]:
        """The tensors an offload of ``kind`` must release: ``"model"``, parameters and gradients;
        ``"optimizer"``, the optimizer state but its step counters (local shards of DTensors).
        The conformance kit's ``offload`` check watches their storage. Default: the parameters
        of :meth:`_modules` and the state of ``self.optimizer``; megatron overrides it."""
        if kind not in ("model", "optimizer"):
            raise ValueError(f"state_tensors({kind!r}): kind must be 'model' or 'optimizer'")
        found: list[torch.Tensor] = []
        if kind == "model":
            for module in self._modules():
                for p in module.parameters():
                    found += [p] if p.grad is None else [p, p.grad]
        elif self.optimizer is not None:
            for state in self.optimizer.state.values():
                found += [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
        return iter([t.to_local() if isinstance(t, DTensor) else t for t in found])

    # ------------------------------------------------------------------ state
    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        """Save resumable state (model, optimizer, scheduler, RNG, step) under ``local_path``.

        Args:
            local_path: checkpoint root directory; the checkpoint of ``global_step`` goes to
                its own subdirectory.
            hdfs_path: optional remote copy (any fsspec URL).
            global_step: the step number recorded and used in the directory name.
            max_ckpt_to_keep: delete older checkpoints beyond this many (None: the config's
                ``checkpoint.max_ckpt_to_keep``); never the newest complete one.

        Collective over all ranks of the engine.
        """
        self._refuse_if_frozen("save_checkpoint (the frozen weights are the HF directory)")
        self._refuse_if_broken("save_checkpoint")
        keep = max_ckpt_to_keep if max_ckpt_to_keep is not None else self.config.checkpoint.max_ckpt_to_keep
        with self._offloader.loaded():
            self._save_checkpoint(local_path, hdfs_path, global_step, keep, self._checkpoint_extra(global_step))

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True) -> int:
        """Restore state saved by :meth:`save_checkpoint`; clears a broken engine.

        Args:
            local_path: a checkpoint root (its newest complete checkpoint is loaded) or one
                checkpoint directory.
            hdfs_path: remote copy to download first when ``local_path`` has none.
            del_local_after_load: delete the downloaded local copy after loading (only a copy
                this call downloaded is ever deleted).

        Returns:
            The restored global step. Collective.
        """
        self._refuse_if_frozen("load_checkpoint")
        with self._offloader.loaded():
            extra = self._load_checkpoint(local_path, hdfs_path, del_local_after_load)
        self.global_step = self._restore_extra(extra)
        self.deferred.reset()
        self._broken = None
        return self.global_step

    def run_state(self) -> RunState:
        """A host copy of everything a training run changes on this engine (``engine_api.run_state``):
        the trainable parameters and their gradients, the optimizer's state and hyperparameters,
        the step, the RNG streams. With :meth:`load_run_state`, several runs that share the
        frozen weights (LoRA runs on one base model) take turns on one engine, each computing
        exactly what it would alone. Per rank, not collective: every rank calls it between calls.
        Refused on a frozen engine."""
        self._refuse_if_frozen("run_state")
        with self._offloader.loaded():
            return capture_run_state(self)

    def load_run_state(self, state: RunState) -> None:
        """Put back a state :meth:`run_state` took (of this engine, or of one built with the same
        settings): the next call continues that run exactly. Checked first: a state of another
        layout raises ``ValueError`` and changes nothing. Per rank, like :meth:`run_state`."""
        self._refuse_if_frozen("load_run_state")
        with self._offloader.loaded():
            restore_run_state(self, state)

    def reset_adapters(self, seed: int) -> None:
        """Draw the LoRA adapters anew, exactly as an engine built with ``engine.seed = seed``
        draws them at build (``B`` zero, ``A`` from the seed), on every rank. Gradients and the
        optimizer state are left as they are (pair it with ``reset_optimizer_state``, or take
        ``run_state`` after it): with :meth:`run_state`, runs of different seeds share one engine.
        Collective-free.

        Raises:
            ValueError: the engine has no adapters (``model.lora.rank`` is 0).
        """
        if not self.config.model.lora.enabled:
            raise ValueError(f"reset_adapters on {type(self).__name__} (model.lora.rank = 0): no LoRA adapters to draw")
        self._refuse_if_frozen("reset_adapters")
        with self._offloader.loaded(optimizer=False), torch.no_grad():
            self._reset_adapters(int(seed))

    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every weight in HF naming and layout (with LoRA,
        merged), for a rollout sync or HF export. Collective: every rank drains the generator.

        ``bucket_mb``: a transfer hint: gather consecutive tensors in flat buckets of about that
        many MB, one collective each (``None``: one tensor each); names, order and values are
        bit-identical either way. A bad size, or a broken engine, raises at the call."""
        self._refuse_if_broken("export_weights")
        return self._exporting(self._export_weights, bucket_bytes(bucket_mb))

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(peft_name, full_tensor)`` for every LoRA adapter weight, named as peft saves
        them (``base_model.model.<module>.lora_A.weight``), for a LoRA-aware rollout engine or a
        peft adapter directory. Collective.

        Raises:
            ValueError: the engine has no adapters (``model.lora.rank`` is 0).
        """
        if not self.config.model.lora.enabled:
            raise ValueError(
                f"export_adapter_weights on {type(self).__name__} (model.lora.rank = {self.config.model.lora.rank}): no LoRA "
                "adapters; fix: build the engine with engine.model.lora.rank > 0 on a backend that supports LoRA, or use export_weights"
            )
        self._refuse_if_broken("export_adapter_weights")
        return self._exporting(self._export_adapter_weights)

    def _exporting(self, export: Callable[..., Iterator], *args) -> Iterator:
        # A generator, so the model is loaded from the first ``next`` until the last, and the
        # optimizer state stays where it is.
        with self._offloader.loaded(optimizer=False):
            yield from export(*args)

    # ------------------------------------------------------------------ templates
    def train_batch(self, batch: TensorDict) -> dict[str, Any]:
        """One optimizer step on ``batch`` (this rank's shard): zero grad, forward/backward,
        optimizer step, LR step. Call inside :meth:`train_mode`.

        Returns:
            Metrics: ``loss``, ``grad_norm``, ``lr`` (after the scheduler step),
            ``step_skipped`` (1.0 when :meth:`optimizer_step` skipped the step for a
            non-finite loss or grad norm: the scheduler does not advance either), and the
            mean over micro-batches of each loss-function metric.
        """
        # The predictions are not returned, so the backend need not assemble them.
        return self._train_step(batch, keep_predictions=False)[0]

    def train_batch_with_outputs(self, batch: TensorDict) -> tuple[dict[str, Any], TensorDict | None]:
        """:meth:`train_batch`, also returning the forward's outputs (``log_probs``, and
        ``entropy`` when the metadata asks for it), detached, in ``batch``'s order (None where
        :attr:`is_output_rank` is False): the outputs of the weights *before* the step, so a
        caller needing them (a policy update whose old-policy log-probs are its own forward's)
        saves a separate forward-only pass. Call inside :meth:`train_mode`. Collective."""
        return self._train_step(batch, keep_predictions=True)

    def _train_step(self, batch: TensorDict, keep_predictions: bool) -> tuple[dict[str, Any], TensorDict | None]:
        self.optimizer_zero_grad()
        predictions, loss, ctx = self.forward_backward_step(batch, ctx={RETURN_PREDICTIONS: keep_predictions})
        grad_norm = self.optimizer_step()
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm, "step_skipped": 0.0}
        if math.isfinite(grad_norm):
            metrics["lr"] = self.lr_scheduler_step()
        else:
            metrics["step_skipped"] = 1.0
        for key, values in ctx.get("metrics", {}).items():
            metrics[key] = sum(values) / len(values)
        return metrics, predictions

    def infer_batch(self, batch: TensorDict) -> TensorDict | None:
        """Forward-only outputs for ``batch`` (this rank's shard). Call inside :meth:`eval_mode`."""
        predictions, _ = self.forward_backward_step(batch, forward_only=True)
        return predictions

    # ------------------------------------------------------------------ guards
    def _refuse_if_frozen(self, what: str) -> None:
        """Raise the frozen-engine error for a training call (``config.frozen``)."""
        if self.config.frozen:
            raise RuntimeError(
                f"{what} on a frozen engine (engine.frozen = True: no optimizer); fix: use eval_mode/infer_batch, or set engine.frozen=false"
            )

    def _refuse_if_broken(self, what: str) -> None:
        """Raise for ``what`` while the weights are invalid: an optimizer step wrote non-finite
        values (:meth:`_check_update`). Training, saving (which could rotate good checkpoints
        out) and exporting them are refused until ``load_checkpoint``."""
        if self._broken:
            raise RuntimeError(f"{what} refused: {self._broken}")

    def _check_update(self, named_params, group: dist.ProcessGroup | None = None) -> None:
        """After an optimizer step that ran: ``engine_api.optim.check_update_finite`` for step
        ``global_step + 1``; a failure marks the engine broken before it propagates.
        Collective over ``group`` (None: the world: every rank holds other shards, and all
        must stop together)."""
        try:
            check_update_finite(named_params, self.global_step + 1, group)
        except NonFiniteUpdateError as exc:
            self._broken = str(exc)
            raise

    # ================================================================== backend hooks
    @abc.abstractmethod
    def _build_model(self) -> None:
        """Join or create the process group, set ``self.device``, build the model from
        ``config.model.path`` and, unless frozen, ``self.optimizer`` and ``self.scheduler``."""

    @abc.abstractmethod
    def _modules(self) -> list[torch.nn.Module]:
        """The modules ``train_mode`` / ``eval_mode`` switch, and whose parameters the default
        hooks train, offload and report."""

    @abc.abstractmethod
    def _step_spec(self) -> StepSpec:
        """What the shared micro-batch loop needs for a call (``kit.StepSpec``): the forward,
        the DP group, how gradients reduce over DP, the vocabulary and position limits."""

    def _forward_backward(self, batch, ctx, forward_only, preprocess_fn, postprocess_fn):
        """``forward_backward_step`` after the guards: the shared loop over :meth:`_step_spec`
        (override to pass your own micro-batch ``runner``, or to clean up per call)."""
        return forward_backward_loop(
            self._step_spec(), batch, self._loss_fn, self.deferred, ctx, forward_only, preprocess_fn, postprocess_fn
        )

    def _param_groups(self) -> list[dict]:
        """The optimizer's parameter groups, as the step reads them (megatron: the torch
        optimizers' groups inside its chained optimizer, which its ``param_groups`` concatenates)."""
        return self.optimizer.param_groups

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers holding the state (default: ``[self.optimizer]``)."""
        return [self.optimizer]

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (with LoRA, the adapters)."""
        return [p for module in self._modules() for p in module.parameters() if p.requires_grad]

    def _grad_buffers(self) -> list[torch.Tensor]:
        """Gradient storage besides the parameters' ``.grad`` that a run owns (megatron DDP's
        ``main_grad`` views); default none."""
        return []

    def _zero_grad(self) -> None:
        """Clear the gradients (default: ``self.optimizer.zero_grad(set_to_none=True)``)."""
        self.optimizer.zero_grad(set_to_none=True)

    def _with_grad(self) -> list[torch.nn.Parameter]:
        params = [p for p in self._trainable_parameters() if p.grad is not None]
        if not params:
            raise RuntimeError("optimizer_step with no gradients; fix: call forward_backward_step (not forward_only) first")
        return params

    def _finish_grads(self) -> None:
        """Complete the gradients before the step (a backend that reduces over DP at the step
        does it here). Default: check that there are gradients."""
        self._with_grad()

    def _scale_grads(self, scale: float) -> None:
        """Multiply every gradient by ``scale`` (deferred normalization's ``1 / denominator``)."""
        for p in self._with_grad():
            p.grad.mul_(scale)

    def _grad_norm(self) -> torch.Tensor | float:
        """The global L2 norm of the gradients, in the form :meth:`_clip_grads` takes it
        (default: torch's total norm, a DTensor for sharded grads; collective then)."""
        return torch.nn.utils.get_total_norm([p.grad for p in self._with_grad()], norm_type=2.0)

    def _clip_grads(self, max_norm: float, total: torch.Tensor | float) -> None:
        """Scale the gradients so their global norm ``total`` is at most ``max_norm``."""
        torch.nn.utils.clip_grads_with_norm_(self._with_grad(), max_norm, total)  # takes the parameters

    def _apply_update(self) -> None:
        """Step the optimizer with the finished, clipped gradients."""
        self.optimizer.step()

    def _updated_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of what a step changed, for the post-step finite check (only
        the trained parameters: with LoRA not the whole frozen base every step)."""
        return ((n, p) for module in self._modules() for n, p in module.named_parameters() if p.requires_grad)

    def _move(self, kind: str, load: bool) -> None:
        """Load (``load``) or offload one part, ``"model"`` or ``"optimizer"`` (a flag, not a
        device: on a CPU-only machine both directions are "cpu"). Default: copies
        (``relocate_module`` / ``relocate_state``), which release the old storage there too."""
        device = self.device if load else torch.device("cpu")
        if kind == "model":
            for module in self._modules():
                relocate_module(module, device)  # moves .grad with each param; FSDP2 re-registers its shards
        elif self.optimizer is not None:
            relocate_state(self.optimizer, device)  # AdamW keeps its step counter on the CPU
        if not load and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _run_owned_state(self) -> RunOwned:
        """Everything a training run owns on this engine, live (``engine_api.run_state`` copies
        it out for :meth:`run_state` and back in place for :meth:`load_run_state`, and reads
        nothing else): the trainable parameters with their gradients, the gradient buffers
        (:meth:`_grad_buffers`), the torch optimizers (:meth:`_torch_optimizers`), the
        attributes :attr:`run_state_attributes` names and the checkpoint extra (scheduler, RNG:
        :meth:`_checkpoint_extra`). Override (extending the base's) only for tensors no hook
        reaches."""
        return RunOwned(
            trainable=self._trainable_parameters(),
            grad_buffers=self._grad_buffers(),
            optimizers=self._torch_optimizers(),
            attributes={name: getattr(self, name) for name in self.run_state_attributes},
            extra=self._checkpoint_extra(self.global_step),
        )

    def _restore_run_owned_state(self, attributes: dict[str, Any], extra: dict) -> None:
        """Set back what :meth:`_run_owned_state` gave besides tensors (``load_run_state``, after
        the tensors were copied in place): the attributes by name, then the checkpoint extra
        (:meth:`_restore_extra`)."""
        for name, value in attributes.items():
            setattr(self, name, value)
        self._restore_extra(extra)

    def _checkpoint_extra(self, global_step: int) -> dict:
        """The per-rank extra state of a checkpoint (``ckpt_layout.make_extra``: scheduler,
        RNG, step); a backend with more RNG state adds it."""
        return make_extra(self.scheduler, global_step)

    @abc.abstractmethod
    def _save_checkpoint(self, local_path: str, hdfs_path: str | None, global_step: int, keep: int | None, extra: dict) -> None:
        """Write model, optimizer and ``extra`` inside the ``ckpt_layout`` protocol, keeping
        ``keep`` checkpoints. Called with everything loaded. Collective."""

    @abc.abstractmethod
    def _load_checkpoint(self, local_path: str, hdfs_path: str | None, del_local_after_load: bool) -> dict:
        """Read and verify a checkpoint, restore model and optimizer state (only after
        everything is read), and return its ``extra``. Called with everything loaded. Collective."""

    def _restore_extra(self, extra: dict) -> int:
        """Apply a loaded checkpoint's ``extra`` (scheduler, RNG); return its global step."""
        return apply_extra(extra, self.scheduler, self.config.seed)

    @abc.abstractmethod
    def _export_weights(self, bucket_bytes: int | None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every weight (``bucket_bytes``: the validated
        transfer hint, None for one tensor per collective). Called with the model loaded."""

    def _reset_adapters(self, seed: int) -> None:
        """Draw the adapters as a build with ``seed`` does (a backend with :attr:`supports_lora`)."""
        raise NotImplementedError(f"{type(self).__name__} sets supports_lora but does not implement _reset_adapters")

    def _export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the LoRA adapters by peft's names (a backend with :attr:`supports_lora`)."""
        raise NotImplementedError(f"{type(self).__name__} sets supports_lora but does not implement _export_adapter_weights")


def _positive_dropout(fields: dict[str, Any]) -> bool:
    """Whether any ``*dropout*`` / ``*pdrop*`` field holds a positive number."""
    return any(
        ("dropout" in name or "pdrop" in name) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for name, v in fields.items()
    )
