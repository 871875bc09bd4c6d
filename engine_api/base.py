"""``BaseEngine``: the contract every backend implements (docs/design.md, section 2)."""

from __future__ import annotations

import abc
import contextlib
import inspect
import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.tensor import DTensor

from engine_api.batch import shard_batch, unshard_batch
from engine_api.config import EngineConfig
from engine_api.losses import LossFn
from engine_api.optim import NonFiniteUpdateError, check_update_finite

PreprocessFn = Callable[[TensorDict, dict], TensorDict]
PostprocessFn = Callable[[TensorDict, TensorDict, dict], TensorDict]
# ``ctx`` key of a training ``forward_backward_step``: False lets the backend skip assembling the
# predictions (returned as None), which ``train_batch`` discards anyway; saves the per-micro-batch
# relayout and the final reorder.
RETURN_PREDICTIONS = "return_predictions"


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


def takes_bucket_mb(method) -> bool:
    """Whether ``method`` (an ``export_weights``) accepts a ``bucket_mb`` keyword, by name or
    through ``**kwargs`` (engines written before the parameter existed do not)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): do not guess
        return False
    return any(p.name == "bucket_mb" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def export_in_buckets(export: Callable[..., Iterator], bucket_mb: float | None, setting: str = "bucket_mb") -> Iterator:
    """``export(bucket_mb=bucket_mb)``, or ``export()`` when ``bucket_mb`` is None or ``export``
    takes no ``bucket_mb`` (an engine written before the parameter existed): then the weights
    move one tensor per collective, with a warning naming ``setting`` (the key that asked for
    buckets). The one place the roles and the rollout decide how to call an export."""
    if bucket_mb is None:
        return export()
    if not takes_bucket_mb(export):
        owner = type(getattr(export, "__self__", export)).__name__
        warnings.warn(
            f"{setting} = {bucket_mb}: {owner}.export_weights takes no bucket_mb, so the weights move one tensor per "
            "collective; fix: give export_weights a bucket_mb=None parameter (engine_api.BaseEngine.export_weights), "
            "or set rollout.sync_bucket_mb=null",
            stacklevel=3,
        )
        return export()
    return export(bucket_mb=bucket_mb)


def relocate_module(module: torch.nn.Module, device: str | torch.device) -> None:
    """Move ``module``'s parameters, gradients and buffers to ``device`` as new copies (in
    place: the ``Parameter`` objects stay, so an optimizer keeps them), releasing the old
    storage. Unlike ``module.to(device)``, which returns the very same tensors when they are
    already there, this also works on a CPU-only machine, where loading and offloading are
    both "cpu" (see the offload duty of :class:`BaseEngine`). An FSDP2 module re-registers its
    shards itself (``FSDPModule._apply``)."""
    module._apply(lambda t: t.to(device, copy=True))


def relocate_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Move ``optimizer``'s state tensors to ``device`` as new copies (see
    :func:`relocate_module`); the step counters stay where they are (AdamW keeps them on the
    CPU)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, copy=True)


class BaseEngine(abc.ABC):
    """A training engine: one model (+ optimizer) on a set of ranks, driven by batches.

    Lifecycle: ``engine = build_engine(config)`` (cheap), ``engine.init_model()``, then
    ``with engine.train_mode(): engine.train_batch(batch)`` or
    ``with engine.eval_mode(): engine.infer_batch(batch)``.

    Data: batches follow ``engine_api.batch`` (jagged TensorDicts). ``forward_backward_step``
    takes this rank's DP shard (see :meth:`shard_data`); outputs are per-token jagged fields
    aligned with ``input_ids`` (``log_probs``, ``entropy`` when the batch's metadata
    ``calculate_entropy`` is True, ``values`` for value heads) in the caller's row order.

    Errors: bad input raises ``ValueError`` before any state (params, grads, optimizer state,
    step counters) changes. Every method that is a collective says so; all ranks of the
    engine must call it together.

    Duties of a backend (the conformance kit, ``python -m engine_api.conformance``, checks each
    one; ``engine_api.kit`` provides the pieces that fulfil them, see
    ``docs/adding-a-backend.md``):

    * **Settings.** Declare :attr:`options_class` (a frozen dataclass with a
      ``config_section``); read it as ``config.backend``. Problems only the backend can see
      (a layout the model's shape cannot take, an unsupported head) come from
      :meth:`check_config`, so ``build_engine`` refuses them before anything is built.
    * **Processes.** ``init_model`` joins the launcher's world when there is one (torchrun's
      environment) and creates a 1-rank group for plain python
      (``kit.ensure_process_group``); it never trains each rank alone under a launcher.
    * **Outputs.** ``log_probs[i]`` is log p(token i | tokens < i) with 0 at position 0, of the
      logits divided by the batch metadata ``temperature`` (default 1.0; the rollout's sampling
      temperature, so PPO ratios compare like with like); ``entropy`` (same alignment, same
      temperature) only when ``calculate_entropy`` is True; ``model.head: value`` gives
      ``values[i]`` predicted from the prefix before token i (0 at position 0), its new head
      seeded by ``config.seed`` identically on every rank. Outputs come back in the caller's
      row order and jagged layout, on ``batch``'s device.
    * **The update.** One optimizer step's loss, gradient and update do not depend on
      micro-batching, dynamic batching, packing vs padding, how a global batch is split over
      calls (``deferred_normalization``) or the DP size: use the shared loop
      (``kit.forward_backward_loop``; a backend with its own schedule plugs it in as the loop's
      ``runner``) and ``kit.clip_and_step``. Gradients average or sum over DP as the backend
      declares (``StepSpec.grads_averaged_over_dp``); the loop compensates.
    * **Abort and skip.** :meth:`optimizer_zero_grad` aborts a window without a trace. A non-finite
      loss or grad norm on any rank skips the step on every rank (agreed collectively); a step
      that ran and left a non-finite weight marks the engine broken (:meth:`_check_update`).
    * **Frozen engines.** ``config.frozen``: no optimizer, no gradient memory; ``train_mode``,
      training calls and ``save_checkpoint`` raise (:meth:`_refuse_if_frozen`), inference works.
    * **Offload.** ``train_mode`` / ``eval_mode`` load what they need onto the compute device
      and, on exit, move what ``config.offload`` names to the CPU; training with offload is
      bit-identical to training without (:meth:`_switch_mode`, :meth:`_offload`). An offload
      releases the compute-device storage of every tensor of the part (parameters and
      gradients; optimizer state) and keeps the values in a separate host copy, on a CPU-only
      machine too, where the "compute device" is the CPU: a move that keeps the old storage
      alive frees nothing there, and on a GPU it would not either (:meth:`state_tensors` is
      how the conformance kit looks). The engine records what is offloaded
      (:attr:`offloaded`, the same on CPU and GPU machines) and refuses to compute on an
      offloaded part (:meth:`_require_loaded`); saving, loading and exporting load what they
      need for the call (:meth:`_loaded`).
    * **Checkpoints.** The directory protocol of ``engine_api.ckpt_layout``: write into the
      temporary directory of ``begin``, then ``commit`` (manifest, completion marker,
      ``latest``, retention, remote copy). Loading verifies the manifest before anything is
      unpickled (``open_checkpoint``), reads tensors with ``weights_only``, changes state only
      after everything is read, never runs code from a checkpoint, and refuses a checkpoint of
      another backend or layout with a ``ValueError``. Resume in a fresh process is bit-exact
      (model, optimizer, scheduler, RNG, step: ``make_extra`` / ``apply_extra``).
    * **Export.** :meth:`export_weights` yields every weight by its HF name, in HF layout.
    * **LoRA** (only a backend that sets :attr:`supports_lora`; ``build_engine`` refuses
      ``model.lora.rank > 0`` for the others): adapters on the ``model.lora.target_modules``,
      only they are trained and checkpointed (with their optimizer state); batch metadata
      ``disable_adapters=True`` makes a forward-only call use the base weights;
      :meth:`export_weights` yields the merged weights and :meth:`export_adapter_weights` the
      adapters alone.
    * **Collectives.** ``init_model``, ``forward_backward_step``, ``optimizer_step``,
      ``unshard_data``, ``save_checkpoint``, ``load_checkpoint``, ``export_weights`` and ``export_adapter_weights`` are
      collective over every rank of the engine; so are ``train_mode`` / ``eval_mode`` when
      loading or offloading involves communication. A bad batch on one rank raises on every
      rank (validation is agreed), so no rank is left waiting.
    """

    #: The backend's own settings: a frozen dataclass with a ``config_section: ClassVar[str]``
    #: naming the engine-config section that holds them (``megatron.*``); ``build_engine``
    #: gives the engine ``config.backend`` as an instance of it. None: no settings.
    options_class: ClassVar[type | None] = None
    #: Whether the backend implements ``model.lora`` (see the LoRA duty above).
    supports_lora: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        """Store the typed config; build nothing heavy (no model, no process groups)."""
        self.config = config
        self._loss_fn: LossFn | None = None
        # Why the weights are invalid (an optimizer step wrote NaN/inf into them), else None.
        self._broken: str | None = None

    # ------------------------------------------------------------------ lifecycle
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

    @abc.abstractmethod
    def init_model(self) -> None:
        """Build/load the model from ``config.model.path``, the optimizer and LR scheduler
        (none for an engine without training, e.g. a reference model), and apply the offload
        policy. Collective over all ranks of the engine."""

    @abc.abstractmethod
    def train_mode(self) -> AbstractContextManager[BaseEngine]:
        """Context manager for training: on enter, params, grads and optimizer state are on
        the compute device and the module is in ``train()``; on exit, what
        ``config.offload`` names goes back to CPU."""

    @abc.abstractmethod
    def eval_mode(self) -> AbstractContextManager[BaseEngine]:
        """Context manager for inference: on enter, params are on the compute device and the
        module is in ``eval()``; on exit, offloaded per ``config.offload``."""

    def _keep(self, max_ckpt_to_keep: int | None) -> int | None:
        """The retention of one save: the argument, else ``config.checkpoint.max_ckpt_to_keep``."""
        return max_ckpt_to_keep if max_ckpt_to_keep is not None else self.config.checkpoint.max_ckpt_to_keep

    def _refuse_if_frozen(self, what: str) -> None:
        """Raise the frozen-engine error for a training call (``config.frozen``)."""
        if self.config.frozen:
            raise RuntimeError(
                f"{what} on a frozen engine (engine.frozen = True: no optimizer); fix: use eval_mode/infer_batch, or set engine.frozen=false"
            )

    def _check_update(self, named_params, group: dist.ProcessGroup | None = None) -> None:
        """After an optimizer step that ran: ``engine_api.optim.check_update_finite`` for step
        ``global_step + 1``; a failure marks the engine broken (see :meth:`_refuse_if_broken`)
        before it propagates. Collective over ``group`` (None: the world)."""
        try:
            check_update_finite(named_params, getattr(self, "global_step", 0) + 1, group)
        except NonFiniteUpdateError as exc:
            self._broken = str(exc)
            raise

    def _refuse_if_broken(self, what: str) -> None:
        """Raise for ``what`` while the weights are invalid: an optimizer step wrote non-finite
        values (``engine_api.optim.check_update_finite``). Training, saving (which could rotate
        good checkpoints out) and exporting them are refused until ``load_checkpoint``."""
        broken = getattr(self, "_broken", None)
        if broken:
            raise RuntimeError(f"{what} refused: {broken}")

    # ------------------------------------------------------------------ shared helpers
    @contextlib.contextmanager
    def _switch_mode(self, modules, training: bool):
        """The one implementation of :meth:`train_mode` / :meth:`eval_mode`: refuse training
        on a frozen or broken engine, load what the mode needs onto ``self.device`` (params;
        optimizer state too when ``training``), set ``train()`` / ``eval()`` on ``modules``,
        and on exit offload what ``config.offload`` names (:meth:`_offload`)."""
        if training:
            self._refuse_if_frozen("train_mode")
            self._refuse_if_broken("train_mode")
        self._load(model=True, optimizer=training)
        for module in modules:
            module.train(training)
        try:
            yield self
        finally:
            self._offload(model=self.config.offload.param, optimizer=self.config.offload.optimizer)

    # ------------------------------------------------------------------ offload bookkeeping
    @property
    def _offload_record(self) -> dict[str, bool]:
        # Which parts are offloaded now (see :attr:`offloaded`), kept by _load / _offload;
        # created on first use, so a backend whose __init__ skips BaseEngine's works too.
        return self.__dict__.setdefault("_offloaded", {"model": False, "optimizer": False})

    @property
    def offloaded(self) -> dict[str, bool]:
        """Which parts are offloaded now: ``{"model": bool, "optimizer": bool}`` ("model" is
        params and grads). True from an offload (a mode's exit under ``config.offload``, or
        :meth:`to` another device) until the part is loaded again (entering a mode, or
        :meth:`to` the compute device).

        This is the engine's record, not a guess from tensor devices: on a CPU-only machine
        the compute device *is* the CPU, so no tensor device shows an offload (the bytes still
        move: into a host copy, the original storage released, see :meth:`state_tensors`), yet
        the record changes exactly as on a GPU. Compute on
        an offloaded part raises (:meth:`_require_loaded`), so a mode that forgot to load
        something fails on every machine, not only where the bytes would be missing."""
        return dict(self._offload_record)

    @property
    def placement(self) -> dict[str, torch.device]:
        """Where each part lives: the CPU while :attr:`offloaded`, else the compute device.

        Derived from the record. Assigning it (as backends written before the record did, in
        ``init_model``) is accepted and ignored: the record decides."""
        device = torch.device(getattr(self, "device", "cpu"))
        return {kind: torch.device("cpu") if off else device for kind, off in self._offload_record.items()}

    @placement.setter
    def placement(self, value) -> None:
        del value  # ignored: see the getter

    def _moves_through_to(self) -> bool:
        # A backend that did not override _move moves through its own ``to`` (a plain move).
        return type(self)._move is BaseEngine._move

    def _load(self, model: bool, optimizer: bool) -> None:
        """Bring each named part back onto the compute device (:meth:`_move`) and record it loaded.

        A backend with its own :meth:`_move` keeps the record exact, so a part already loaded
        is not touched. A backend whose ``to`` is a plain move (no ``_move``) is moved every
        time, as before the record existed: its manual ``to`` calls do not update the record,
        so only the move itself can be trusted to put the part where the mode needs it."""
        plain = self._moves_through_to()
        for kind, wanted in (("model", model), ("optimizer", optimizer)):
            if wanted and (plain or self._offload_record[kind]):
                self._move(kind, load=True)
                self._offload_record[kind] = False

    def _offload(self, model: bool, optimizer: bool) -> None:
        """Move each named part to the CPU (:meth:`_move`) and record it offloaded (a part
        already offloaded is not touched, except for a plain-``to`` backend: see :meth:`_load`).
        On a CPU-only machine the move still copies into host storage and releases the old one
        (``self._relocate_module`` / ``_relocate_state``), so the kit can see that it happened.
        The optimizer goes first, while the model is still loaded (megatron reads the model's
        storages to keep the ones its optimizer shares)."""
        plain = self._moves_through_to()
        for kind, wanted in (("optimizer", optimizer), ("model", model)):
            if wanted and (plain or not self._offload_record[kind]):
                self._move(kind, load=False)
                self._offload_record[kind] = True

    # Copying moves for a ``_move`` (see relocate_module): reachable as ``self._relocate_*``
    # by a backend that imports only ``engine_api.kit``.
    _relocate_module = staticmethod(relocate_module)
    _relocate_state = staticmethod(relocate_state)

    def _move(self, kind: str, load: bool) -> None:
        """Load (``load``: onto the compute device) or offload (to the CPU) one part,
        ``"model"`` or ``"optimizer"``. A flag, not a device: on a CPU-only machine both
        directions are "cpu", and a backend that frees storage (megatron) must still know
        which one it is. Default: :meth:`to` with that part alone, for a backend whose ``to``
        is a plain move; a backend whose ``to`` goes through :meth:`_load_or_offload` must
        override this (else ``to`` and ``_move`` would call each other: refused with
        ``NotImplementedError``). An override moves by copying (``self._relocate_module``,
        ``self._relocate_state``) or frees storage in place (megatron), so that an offload
        releases memory on a CPU-only machine too (the offload duty)."""
        if self.__dict__.get("_routing_to"):
            raise NotImplementedError(
                f"{type(self).__name__}.to goes through _load_or_offload, so it must override _move(kind, load) to move the tensors"
            )
        self.to(self.device if load else "cpu", model=kind == "model", optimizer=kind == "optimizer")

    def state_tensors(self, kind: str) -> Iterator[torch.Tensor]:
        """The tensors an offload of ``kind`` must move: ``"model"``, the parameters and their
        gradients; ``"optimizer"``, the optimizer state (not the step counters, which AdamW
        keeps on the CPU anyway). DTensors are given as their local shards.

        Read by the conformance kit's ``offload`` check, which looks at their storage: while
        loaded they live on the compute device; after an offload, each storage seen while
        loaded must be released (freed, or resized to 0 bytes in place), on a CPU-only machine
        too. Default: the parameters (and ``.grad``) of every ``torch.nn.Module`` attribute of
        the engine (or list / tuple of them) and the state of every ``torch.optim.Optimizer``
        attribute. Override it when the engine keeps them elsewhere (megatron: gradient
        buffers and its own optimizer wrapper); yield nothing for a part the engine does not
        have (a frozen engine's optimizer)."""
        if kind not in ("model", "optimizer"):
            raise ValueError(f"state_tensors({kind!r}): kind must be 'model' or 'optimizer'")
        found: list[torch.Tensor] = []
        for value in vars(self).values():
            items = value if isinstance(value, (list, tuple)) else [value]
            for item in items:
                if kind == "model" and isinstance(item, torch.nn.Module):
                    for p in item.parameters():
                        found += [p] if p.grad is None else [p, p.grad]
                elif kind == "optimizer" and isinstance(item, torch.optim.Optimizer):
                    for state in item.state.values():
                        found += [v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step"]
        return iter([t.to_local() if isinstance(t, DTensor) else t for t in found])

    def _load_or_offload(self, device: str | torch.device, model: bool, optimizer: bool) -> None:
        """:meth:`to` for a backend that keeps :attr:`offloaded` through :meth:`_load` /
        :meth:`_offload`: the compute device (``"cuda"`` matches ``cuda:<this rank's index>``)
        loads, the CPU offloads; on a CPU-only machine ``"cpu"`` is the compute device, so it
        loads. Any other device is refused (``ValueError``, nothing moved)."""
        device, compute = torch.device(device), torch.device(self.device)
        if device.type == compute.type and device.index in (None, compute.index):
            move = self._load
        elif device.type == "cpu":
            move = self._offload
        else:
            raise ValueError(
                f"engine.to({str(device)!r}): this rank computes on {compute} and offloads to the CPU; "
                f"fix: pass {str(compute)!r} to load or 'cpu' to offload"
            )
        self.__dict__["_routing_to"] = True
        try:
            move(model=model, optimizer=optimizer)
        finally:
            self.__dict__["_routing_to"] = False

    def _require_loaded(self, model: bool, optimizer: bool) -> None:
        """Raise a ``RuntimeError`` (nothing changed) when a part this call computes with is
        offloaded: on a GPU it would compute on the wrong device or on freed storage."""
        for kind, wanted in (("model", model), ("optimizer", optimizer)):
            if wanted and self._offload_record[kind]:
                raise RuntimeError(
                    f"the {kind} is offloaded (engine.offloaded[{kind!r}] is True); fix: call this inside "
                    "engine.train_mode() / eval_mode(), or engine.to(<compute device>) first"
                )

    @contextlib.contextmanager
    def _loaded(self, optimizer: bool = True):
        """The model (and, when ``optimizer``, the optimizer state) on the compute device for
        the duration: saving and loading need both, exporting only the model (the rollout sync
        should not bring the Adam moments onto the GPU). What was offloaded before is
        offloaded again after."""
        saved = dict(self._offload_record)
        self._load(model=True, optimizer=optimizer)
        try:
            yield
        finally:
            self._offload(model=saved["model"], optimizer=saved["optimizer"])

    def _step_scheduler(self) -> float:
        """The one implementation of :meth:`lr_scheduler_step` over ``self.scheduler``."""
        self._refuse_if_frozen("lr_scheduler_step")
        self.scheduler.step()
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ compute
    def set_loss_fn(self, loss_fn: LossFn) -> None:
        """Set the loss used by :meth:`forward_backward_step` (see ``engine_api.losses.LossFn``)."""
        self._loss_fn = loss_fn

    @abc.abstractmethod
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
            ctx: a dict passed to the hooks and returned; the engine adds ``ctx["norm"]``
                (the call's ``NormContext``, training only) and ``ctx["metrics"]`` (per key, a
                list with one value per micro-batch, from the loss function). A training
                call with ``ctx[RETURN_PREDICTIONS] = False`` may skip assembling the
                predictions and return None for them (``train_batch`` does this).
            forward_only: no backward, no loss; gradients untouched.
            preprocess_fn: ``fn(micro_batch, ctx) -> micro_batch`` before each forward.
            postprocess_fn: ``fn(micro_batch, outputs, ctx) -> outputs`` after each forward,
                before the loss.

        Returns:
            ``(predictions, ctx)`` if ``forward_only`` else ``(predictions, loss, ctx)``:
            ``predictions`` is a TensorDict of this rank's rows in ``batch``'s order, on
            ranks where :attr:`is_output_rank` is True (None elsewhere); ``loss`` is the
            call's global loss (sum of micro-batch contributions over all DP ranks), the
            same float on every rank. Collective over all ranks of the engine.

        Raises:
            ValueError: a malformed batch, or no loss function set for a training call;
                raised before any gradient is touched.
        """

    @abc.abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Clear gradients (and backend grad buffers) and the accumulation window (deferred
        counts, recorded losses). Calling it between ``forward_backward_step`` calls aborts
        that window without a trace: params, optimizer state, step counter and LR are as
        before the window, and the next window equals one on an engine that never saw the
        aborted data. Also the way to recover after a ``forward_backward_step`` that raised
        part-way (e.g. in the loss function). Call it inside ``train_mode``: the built-in
        backends refuse it while the model or the optimizer is :attr:`offloaded`."""

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Finish the gradient sync, apply deferred normalization, clip, and step.

        Returns:
            The global gradient norm before clipping (the same on every rank). If the norm,
            or the loss of any call since the last step, is not finite on *any* rank, the
            step is skipped on *every* rank (the decision is agreed collectively): params,
            optimizer state and the step counter are untouched, the window is reset, and a
            non-finite value is returned (the norm itself, or NaN when only a loss was not
            finite). Collective.

        Raises:
            engine_api.optim.NonFiniteUpdateError: the step ran and left a parameter NaN or
                inf (on every rank, naming the step). The engine then refuses to train, save
                or export until a checkpoint is loaded (see ``_refuse_if_broken``).
        """

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR scheduler by one step and return the new learning rate."""

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

    # ------------------------------------------------------------------ state
    @abc.abstractmethod
    def to(self, device: str | torch.device, model: bool = True, optimizer: bool = True) -> None:
        """Move the model (params and grads) and/or optimizer state to ``device`` (manual
        load/offload; ``train_mode``/``eval_mode`` do it by policy). The built-in backends
        read the compute device as "load" and the CPU as "offload" (any other device raises
        ``ValueError``), and keep :attr:`offloaded` current (``_load_or_offload``)."""

    @abc.abstractmethod
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

    @abc.abstractmethod
    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True) -> int:
        """Restore state saved by :meth:`save_checkpoint`.

        Args:
            local_path: a checkpoint root (its newest complete checkpoint is loaded) or one
                checkpoint directory.
            hdfs_path: remote copy to download first when ``local_path`` has none.
            del_local_after_load: delete the downloaded local copy after loading (only a copy
                this call downloaded is ever deleted).

        Returns:
            The restored global step. Collective.
        """

    @abc.abstractmethod
    def export_weights(self, bucket_mb: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every weight, in HF naming and layout, for
        weight sync into a rollout/inference model or HF export (with LoRA: the base weights
        with the adapters merged in). Collective: every rank must drain the generator.

        ``bucket_mb``: a transfer hint. ``None`` moves one tensor per collective; a size in MB
        asks the backend to gather consecutive tensors in flat buckets of about that size (one
        collective per bucket: fewer, larger transfers, extra memory about a bucket or a few). The names,
        order and values must be the same either way (bit-identical); a backend that cannot
        bucket may ignore it. Validate it eagerly with :func:`bucket_bytes` (a bad size raises
        at the call, not at the first ``next``)."""

    def export_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(peft_name, full_tensor)`` for every LoRA adapter weight, named as peft saves
        them (``base_model.model.<module>.lora_A.weight``), for a LoRA-aware rollout engine or a
        peft adapter directory. Collective.

        Raises:
            ValueError: the engine has no adapters (``model.lora.rank`` is 0, or the backend
                does not support LoRA).
        """
        raise ValueError(
            f"export_adapter_weights on {type(self).__name__} (model.lora.rank = {self.config.model.lora.rank}): no LoRA adapters; "
            "fix: build the engine with engine.model.lora.rank > 0 on a backend that supports LoRA, or use export_weights"
        )

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
        self.optimizer_zero_grad()
        # The predictions are not returned, so the backend need not assemble them.
        _, loss, ctx = self.forward_backward_step(batch, ctx={RETURN_PREDICTIONS: False})
        grad_norm = self.optimizer_step()
        metrics: dict[str, Any] = {"loss": loss, "grad_norm": grad_norm, "step_skipped": 0.0}
        if math.isfinite(grad_norm):
            metrics["lr"] = self.lr_scheduler_step()
        else:
            metrics["step_skipped"] = 1.0
        for key, values in ctx.get("metrics", {}).items():
            metrics[key] = sum(values) / len(values)
        return metrics

    def infer_batch(self, batch: TensorDict) -> TensorDict | None:
        """Forward-only outputs for ``batch`` (this rank's shard). Call inside :meth:`eval_mode`."""
        predictions, _ = self.forward_backward_step(batch, forward_only=True)
        return predictions
