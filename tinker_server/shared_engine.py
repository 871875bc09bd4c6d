"""The in-process engine of a base model and LoRA signature, shared by its training runs.

A run trains on an engine built from the base model's HF directory with ``model.lora`` (rank,
alpha and the modules the Tinker toggles select), ``loss_agg_mode=sum`` (every Tinker loss is a
token sum) and no deferred normalization. Runs of one :class:`~tinker_server.signature.Signature`
share it (:class:`SharedEngine`): each run's adapters, gradients, AdamW state, step and RNG are
swapped in for its calls through the engine contract's ``run_state`` / ``load_run_state``, once
per call: ``with shared.serving(run) as engine:``. Tinker's call pattern maps onto the engine
contract directly (:class:`EngineRun`):

* ``forward_backward(datums, loss_fn)``: one ``forward_backward_step`` of the datums with
  ``target_ids`` (scored without a shift, ``engine_api.logprobs``) and the datum loss
  (``roles.datum_losses``). Gradients accumulate over calls until ``optim_step``, as Tinker's do;
  a split of the datums over calls (or chunks, or DP ranks) gives the same sum.
* ``optim_step(AdamParams)``: ``set_optim_hparams`` (lr, betas, eps, weight decay, clipping: they
  may change every step), ``optimizer_step``, then the gradients are cleared.
* ``save_state`` / ``load_state``: the engine's own checkpoint (model, optimizer, RNG, step);
  a load without the optimizer clears the AdamW moments afterwards.
* ``sampler``: a snapshot of the run's weights (``tinker_server.snapshots``).

The loss request arrives checked (``datums.check_loss_request``, by the HTTP layer); what the
engine itself refuses (``ValueError``: token ids, lengths, AdamW settings) it refuses before any
state changes, and a run answers it as a ``contract.UserError``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from roles.datum_losses import batch_loss, engine_loss_fn
from tinker_server.config import RunSettings
from tinker_server.contract import AdamIn, DatumIn, ForwardBackwardOut, LoraIn, UserError
from tinker_server.datums import datums_to_batch, loss_settings
from tinker_server.signature import Signature, run_seed
from tinker_server.snapshots import RolloutPool, Snapshot, adapter_snapshot, snapshot

if TYPE_CHECKING:
    from engine_api.base import BaseEngine

UNLOADED = "this training run was unloaded; fix: create a new one (create_model) or load_state a checkpoint into one"


def available_host_bytes() -> int | None:
    """The host memory available now (Linux ``MemAvailable``); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class SharedEngine:
    """One in-process engine of a base model and LoRA :class:`Signature`, shared by its runs
    (``engines.RunEngine``).

    The engine holds the frozen base weights once; each run owns its adapters, their gradients,
    the AdamW state, the step and the RNG streams (``BaseEngine.run_state``). One run is resident
    at a time: a call of another run takes the resident's state out to host memory (pinned on a
    GPU) and puts the caller's in (:meth:`serving`), so each run computes exactly what it would on
    an engine of its own. Calls are serialized by the server's one worker thread, the runs taking
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

    def open_run(self, base_model: str, lora: LoraIn, pool: RolloutPool | None, check_memory: bool = True) -> EngineRun:
        """A new run of ``lora`` on this engine. ``check_memory``: refused (``UserError`` naming
        the sizes) when the host has no room for its state beside the runs already served (the
        engine's first run needs no room beyond the engine itself); off on a Ray worker, whose
        runs the server admits by ``server.max_runs`` alone."""
        if check_memory and self.runs:
            self._admit(lora)
        self.runs += 1
        return EngineRun(base_model, self, lora, pool)

    def _admit(self, lora: LoraIn) -> None:
        """Memory, not a count of engines, bounds the runs an engine serves."""
        available = available_host_bytes()
        if available is not None and available < 2 * self.run_bytes:  # (a margin for the swap's copies)
            raise UserError(
                f"create_model: a run on {self.signature.describe()} (rank {lora.rank}) keeps about "
                f"{self.run_bytes / 2**20:.0f} MB of host memory while another run is resident, and this machine has "
                f"{available / 2**20:.0f} MB available; fix: unload runs (unload_model, or finish sessions), or lower server.max_runs"
            )

    @contextlib.contextmanager
    def serving(self, run: EngineRun) -> Iterator[BaseEngine]:
        """The engine with ``run``'s state in it, for one call of ``run`` (the resident run's
        state is taken out to the host first; a run's first call starts from the engine's initial
        state with its adapters drawn for its seed). The run stays resident until another run's
        call: the server's one worker thread runs every call.

        Raises:
            UserError: ``run`` was closed (unloaded).
        """
        if run.closed:
            raise UserError(UNLOADED)
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
        yield self.engine

    def close_run(self, run: EngineRun) -> None:
        """``run`` is closed: its state is dropped, and with the last run the engine closes."""
        if self.resident is run:
            self.resident = None
        run.state = None
        self.runs -= 1
        if self.runs == 0:
            self.close()

    @property
    def closed(self) -> bool:
        """Whether the engine was closed (its last run closed)."""
        return self.engine is None

    def close(self) -> None:
        """Free the engine (its model, optimizer and the initial run state)."""
        self.engine = self.initial = None


class EngineRun:
    """A training run (``contract.TrainingRun``) on a :class:`SharedEngine` (in the server's
    process, or one rank's part on a Ray worker: ``ray_engine.WorkerHost``); each call swaps this
    run's state in once, ``with self.shared.serving(self) as engine:``. Opened by
    :meth:`SharedEngine.open_run`."""

    def __init__(self, base_model: str, shared: SharedEngine, lora: LoraIn, pool: RolloutPool | None) -> None:
        self.base_model, self.lora, self.pool, self.shared = base_model, lora, pool, shared
        self.seed = run_seed(lora)
        self.state = None  # this run's state while another run is resident (None: resident, or not started)
        self.steps = 0
        self.broken: str | None = None  # why the run refuses to train (a step wrote non-finite weights), until a load
        self.closed = False

    # ------------------------------------------------------------------ training
    def forward_backward(self, datums: list[DatumIn], loss_fn: str, loss_fn_config: dict | None, forward_only: bool) -> ForwardBackwardOut:
        """``contract.TrainingRun.forward_backward`` (the loss request checked by the caller)."""
        self._refuse_if_broken("forward_backward")
        config = loss_settings(loss_fn, loss_fn_config)
        with self.shared.serving(self) as engine:
            dp = engine.dp_size
            batch = datums_to_batch(datums, loss_fn, multiple_of=dp)
            local = engine.shard_data(batch) if dp > 1 else batch
            try:
                if forward_only:
                    with engine.eval_mode():
                        preds = engine.infer_batch(local)
                else:
                    engine.set_loss_fn(engine_loss_fn(loss_fn, config))
                    with engine.train_mode():
                        preds, loss, _ = engine.forward_backward_step(local)
            except ValueError as exc:  # the engine's input checks (vocabulary, length) run before any state changes
                raise UserError(str(exc)) from None
            if dp > 1:
                preds = engine.unshard_data(preds)  # collective: every rank gets the whole batch in order
            if forward_only:  # the loss of the whole batch, from the gathered log-probs (padding rows count 0)
                loss = float(batch_loss(loss_fn, preds["target_log_probs"].values(), batch, config))
            elif not math.isfinite(float(loss)):
                # Finite inputs can still overflow float32 (weights or advantages near 1e38): the engine
                # would skip the next optimizer step without a word. The gradients of this window are
                # dropped instead, and the client is told.
                with engine.train_mode():
                    engine.optimizer_zero_grad()
                raise UserError(
                    f"forward_backward: the {loss_fn} loss of these datums is {float(loss)} (float32 overflowed: are weights or "
                    "advantages near 1e38?); the gradients accumulated since the last optim_step were discarded, so the next "
                    "optim_step starts from none; fix: scale the weights / advantages down and send the datums again"
                )
        rows = preds["target_log_probs"].unbind()[: len(datums)]
        return ForwardBackwardOut([{"logprobs": row.detach().float().cpu()} for row in rows], {"loss:sum": float(loss)})

    def optim_step(self, adam: AdamIn) -> dict[str, float]:
        """``contract.TrainingRun.optim_step``: AdamW's settings for this step, the step, the
        gradients cleared. A step that writes non-finite weights breaks the run until a load."""
        from engine_api.optim import NonFiniteUpdateError

        self._refuse_if_broken("optim_step")
        with self.shared.serving(self) as engine:
            try:  # every value is checked by the engine before any changes
                engine.set_optim_hparams(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                    clip_grad=None if adam.grad_clip_norm == 0 else adam.grad_clip_norm,
                )
            except ValueError as exc:
                raise UserError(f"adam_params: {exc}; fix: lr, weight_decay >= 0, betas in [0, 1), eps > 0, grad_clip_norm >= 0") from None
            try:
                with engine.train_mode():
                    norm = engine.optimizer_step()
                    engine.optimizer_zero_grad()
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
        """The engine's checkpoint of this run into ``directory/engine``."""
        self._refuse_if_broken("save_state")
        directory.mkdir(parents=True, exist_ok=True)
        with self.shared.serving(self) as engine:
            engine.save_checkpoint(str(directory / "engine"), global_step=self.steps)

    def load_state(self, directory: Path, with_optimizer: bool) -> None:
        """This run's state from a :meth:`save_state` directory; without the optimizer AdamW
        starts afresh (its moments and step count), as on a new run."""
        root = directory / "engine"
        if not root.is_dir():
            raise UserError(f"path: {directory.name!r} holds no training state; fix: a path from save_state")
        with self.shared.serving(self) as engine:
            self.steps = engine.load_checkpoint(str(root), del_local_after_load=False)
            self.broken = None  # the engine's weights are the checkpoint's again
            with engine.train_mode():
                if not with_optimizer:
                    engine.reset_optimizer_state()
                engine.optimizer_zero_grad()

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The run's weights with the adapters merged, by HF name, on the CPU (collective)."""
        with self.shared.serving(self) as engine:
            return {k: v.detach().clone().cpu() for k, v in engine.export_weights()}

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters by peft's names, on the CPU (collective)."""
        with self.shared.serving(self) as engine:
            return {k: v.detach().clone().cpu() for k, v in engine.export_adapter_weights()}

    def sampler(self, directory: Path | None) -> Snapshot:
        """``contract.TrainingRun.sampler``: the run's adapter on the base when the rollout
        engine serves it (``rollout.lora_rank``, unnamed), else its merged weights."""
        self._refuse_if_broken("save_weights_for_sampler")
        if directory is None and self.pool is not None and self.pool.serves_adapter(self.lora.rank, self.shared.signature.modules):
            return adapter_snapshot(self.pool, self.adapter_weights(), self.lora.rank, self.shared.engine.config.model.lora.alpha)
        return snapshot(self.pool, self.base_model, self.merged_weights(), directory)

    def close(self) -> None:
        """Hand the run back to its engine (idempotent); later calls are refused by name."""
        if not self.closed:
            self.closed = True
            self.shared.close_run(self)
