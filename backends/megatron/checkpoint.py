"""Megatron checkpoint contents: ``megatron.core.dist_checkpointing`` of the model chunks'
and the optimizer's sharded state dicts, plus per-rank ``extra_rank<r>.pt`` (scheduler, RNG
incl. megatron's tracker, step), inside the shared directory protocol of
``engine_api.ckpt_layout`` (temp dir, atomic rename, ``latest`` marker, retention, remote)."""

from __future__ import annotations

import queue

import torch
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from backends.megatron.parallel import ParallelSizes
from backends.megatron.precision import unwrap
from engine_api.kit import ckpt_layout

BACKEND = "megatron"  # recorded in enginekit.json

# How the distributed optimizer lays its state out in a checkpoint. megatron-core 0.16's default
# ("fully_sharded_model_space", deprecated) raises "ShardedTensor.flattened_range is not
# supported" on save; "dp_reshardable" is what megatron's own training loop uses (resumable at
# the same TP/PP, any DP). Plain (non-distributed) optimizers ignore the key.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _model_sd(chunk, lora: dict) -> dict:
    """One chunk's sharded state dict; with LoRA only the adapters (``chunk.lora``): the frozen
    base is the HF directory the engine loads at init."""
    sd = chunk.module.sharded_state_dict()
    return {k: v for k, v in sd.items() if k.startswith(_ADAPTERS)} if lora else sd


_ADAPTERS = "lora."  # backends.megatron.lora.ChunkAdapters, registered as chunk.lora


def _sharded(model_chunks, optimizer, is_loading: bool, lora: dict) -> dict:
    model_sd = {f"model{i}": _model_sd(chunk, lora) for i, chunk in enumerate(model_chunks)}
    merged = {k: v for sd in model_sd.values() for k, v in sd.items()}
    return {**model_sd, "optimizer": optimizer.sharded_state_dict(merged, is_loading=is_loading, metadata=dict(_OPTIMIZER_METADATA))}


def _results_in_process() -> None:
    """Make megatron's checkpoint writer report its results through an in-process queue.

    megatron-core creates that queue lazily with ``multiprocessing.get_context("spawn").Manager()``,
    which starts a helper process by re-running the user's ``__main__``: a script without an
    ``if __name__ == "__main__":`` guard crashes there (EOFError), and every process that saves
    keeps a ~270 MB manager alive. The engine saves synchronously (``execute_sync``: the writer
    function runs in this process and puts its results on the queue that this process then reads),
    so a plain ``queue.Queue`` carries them; the writer's worker processes are forked and report
    through their own queue. ``tests/launch`` saves from a script without the guard.
    """
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def layout() -> dict:
    """The model-parallel layout recorded with a checkpoint (``enginekit.json``): a resume may
    change the data-parallel size but not these (the ``dp_reshardable`` optimizer layout)."""
    return {**ParallelSizes.current().kept_on_resume(), "data_parallel_size": mpu.get_data_parallel_world_size()}


def optimizer_record(dtype: str, distributed: bool) -> dict:
    """What the optimizer state's layout depends on besides the model-parallel sizes and LoRA,
    recorded with a checkpoint (``enginekit.json`` ``optimizer``) and checked by :func:`load`
    before anything is read: ``model.dtype`` (bfloat16 / float16: mixed precision, fp32 main
    parameters in the state; float32: none) and ``megatron.use_distributed_optimizer`` (the
    state sharded over data-parallel ranks, or whole)."""
    return {"model_dtype": dtype, "use_distributed_optimizer": bool(distributed)}


def _mains(dtype: str) -> str:
    return "mixed precision: fp32 main parameters in the optimizer state" if dtype != "float32" else "no main parameters"


def optimizer_mismatch(saved: dict | None, now: dict) -> str | None:
    """Why a checkpoint whose optimizer state was saved as ``saved`` (:func:`optimizer_record`;
    None: a checkpoint from before the record, not checked) cannot load into an engine whose
    state is laid out as ``now`` (None: it can). bfloat16 and float16 share the layout (both keep
    fp32 mains; their half parameters follow the mains at the next step) and load into each other."""
    if not saved:
        return None
    problems, fixes = [], []
    was, dtype = saved.get("model_dtype"), now["model_dtype"]
    if (was == "float32") != (dtype == "float32"):
        problems.append(f"model.dtype = {dtype!r} in this engine ({_mains(dtype)}), saved with {was!r} ({_mains(was)})")
        fixes.append(f"model.dtype={was}")
    was_distributed, distributed = saved.get("use_distributed_optimizer"), now["use_distributed_optimizer"]
    if was_distributed != distributed:
        problems.append(f"megatron.use_distributed_optimizer = {distributed} in this engine, saved with {was_distributed}")
        fixes.append(f"megatron.use_distributed_optimizer={str(was_distributed).lower()}")
    if not problems:
        return None
    in_recipe = " ".join(f"engine.{fix}" for fix in fixes)
    return (
        f"its optimizer state does not fit this engine: {'; '.join(problems)} (nothing was loaded); fix: resume with "
        f"{' and '.join(fixes)} (a recipe's {in_recipe}); to go on with this engine's settings, export the weights from a "
        "run resumed as saved (trainer.save_hf) and start a new run from them"
    )


def save(
    model_chunks,
    optimizer,
    extra: dict,
    root: str,
    step: int,
    keep: int | None,
    remote: str | None,
    lora: dict | None = None,
    optimizer_layout: dict | None = None,
) -> str:
    """Save the sharded model + optimizer state and ``extra``. Collective. With LoRA (``lora``:
    the settings, recorded in ``enginekit.json``) only the adapters and their optimizer state.
    ``optimizer_layout`` (:func:`optimizer_record`) is recorded there too, for :func:`load`.

    Raises:
        CheckpointError: writing failed (a full disk: named, with the fix); the incomplete save
            is removed and earlier checkpoints are intact.
    """
    _results_in_process()
    tmp = ckpt_layout.begin(root, step)
    with ckpt_layout.writing(tmp):  # a full disk: CheckpointError naming it; the incomplete save removed
        dist_checkpointing.save(_sharded(model_chunks, optimizer, False, lora or {}), tmp)
        ckpt_layout.save_extra(tmp, extra)
    info = {"backend": BACKEND, "layout": layout(), "lora": lora or {}, "optimizer": optimizer_layout or {}}
    return ckpt_layout.commit(root, step, keep, remote, info)


def load(
    model_chunks,
    optimizer,
    local_path: str,
    remote: str | None,
    del_local_after_load: bool,
    verify: bool = True,
    lora: dict | None = None,
    optimizer_layout: dict | None = None,
) -> dict:
    """Load in place; return this rank's ``extra``. Collective.

    ``local_path`` without a complete checkpoint: ``remote`` is downloaded into it first, and
    deleted after loading when ``del_local_after_load`` (else kept as a local checkpoint).
    The checkpoint is verified first (``ckpt_layout.open_checkpoint``; ``verify``: with
    sha256). The data-parallel size may differ from the save's (dist_checkpointing reshards;
    ``ckpt_layout.load_extra`` says what happens to the RNG streams); TP / PP / VPP may not.
    ``optimizer_layout``: this engine's :func:`optimizer_record`, checked against the saved one.

    Raises:
        CorruptCheckpointError: verification failed; nothing was loaded.
        ValueError: another backend's checkpoint, another model-parallel layout, another
            optimizer-state layout (``model.dtype`` float32 vs bfloat16 / float16, the
            distributed optimizer on vs off: :func:`optimizer_mismatch`), other LoRA settings, or
            another model (a tensor's global shape differs: named with both shapes); nothing was
            loaded.
        CheckpointError: the load itself failed (naming the checkpoint).
    """
    path, downloaded, info = ckpt_layout.open_checkpoint(local_path, remote, not del_local_after_load, verify)
    lora = lora or {}
    problem = _incompatible(info) or ckpt_layout.lora_mismatch(info.get("lora") or {}, lora)
    if not problem and optimizer_layout is not None:
        problem = optimizer_mismatch(info.get("optimizer"), optimizer_layout)
    if problem:
        ckpt_layout.finish_load(downloaded)
        raise ValueError(f"checkpoint {path}: {problem}")
    try:  # another model's checkpoint: refused by name before megatron's shape error, state untouched
        ckpt_layout.check_shapes(path, _model_shapes(model_chunks, lora))
    except ValueError:
        ckpt_layout.finish_load(downloaded)
        raise
    with ckpt_layout.reading(path):
        _ensure_optimizer_state(optimizer)
        state = dist_checkpointing.load(_sharded(model_chunks, optimizer, True, lora), path)
        for i, chunk in enumerate(model_chunks):
            if lora:  # the adapters only: every one of them must be set
                unwrap(chunk).lora.load_state_dict({k.removeprefix(_ADAPTERS): v for k, v in state[f"model{i}"].items()})
            else:
                chunk.module.load_state_dict(state[f"model{i}"])
        steps = _loaded_steps(optimizer, state["optimizer"])
        with torch.no_grad():  # the distributed optimizer copies fp32 main params in place: views of params that require grad
            optimizer.load_state_dict(state["optimizer"])
        _restore_steps(optimizer, steps)
    extra = ckpt_layout.load_extra(path, info)
    ckpt_layout.finish_load(downloaded)
    return extra


def _model_shapes(model_chunks, lora: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> global shape of this rank's model tensors (dist_checkpointing saves each
    ``ShardedTensor`` under its key with its global shape; factories are built to see theirs)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[str, tuple[int, ...]] = {}

    def walk(item) -> None:
        if isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)
        elif isinstance(item, ShardedTensorFactory):
            walk(item.build())
        elif isinstance(item, ShardedTensor) and item.flattened_range is None:
            out[item.key] = tuple(item.global_shape)

    for chunk in model_chunks:
        walk(_model_sd(chunk, lora))
    return out


def has_optimizer_state(optimizer) -> bool:
    """Whether the torch optimizers inside ``optimizer`` hold state (they do after a step)."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(bool(opt.optimizer.state) for opt in opts if opt.get_parameters())


def _incompatible(info: dict) -> str | None:
    """Why this process cannot load a checkpoint with marker ``info`` (None: it can)."""
    if info.get("backend") != BACKEND:
        return f"written by backend {info.get('backend')!r}; fix: load it with that engine.strategy"
    saved, fixed = info.get("layout", {}), ParallelSizes.current().kept_on_resume()
    changed = [f"megatron.{k} = {size} (saved with {saved.get(k)})" for k, size in fixed.items() if saved.get(k) != size]
    if changed:
        return (
            f"saved with another model-parallel layout: {'; '.join(changed)}; fix: resume with the sizes it was saved with "
            "(the data-parallel size may change)"
        )
    return None


# ----------------------------------------------------------------------------- distributed optimizer
# megatron-core 0.16 on CPU (no TE/Apex: torch Adam keeps a per-parameter ``step`` tensor) cannot
# resume a DistributedOptimizer in a fresh process as is; the helpers below fill the gaps.


def _distributed(optimizer, loaded: dict | None = None) -> list:
    """``(DistributedOptimizer, its part of the loaded optimizer state or None)`` pairs."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [None] * len(opts) if loaded is None else [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    return [(opt, part) for opt, part in zip(opts, parts, strict=True) if isinstance(opt, DistributedOptimizer)]


def _ensure_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors before the load:
    its ``state_dict`` (called to build the sharded state dict) reads the step from them and
    asserts there is one. megatron-core initialises them the same way for its FSDP path (one
    zero-gradient step); the load overwrites every value that step touched."""
    for opt, _ in _distributed(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _loaded_steps(optimizer, loaded: dict) -> list:
    """The Adam step each distributed optimizer had when saved (kept in its param groups)."""
    out = []
    for _, part in _distributed(optimizer, loaded):
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        out.append(steps.pop() if len(steps) == 1 else None)
    return out


def _restore_steps(optimizer, steps: list) -> None:
    """Give every parameter its own Adam step tensor holding the saved step.

    ``DistributedOptimizer.load_state_dict`` assigns one *shared* step tensor to every parameter
    (torch Adam then adds 1 to it once per parameter per step) and then copies into it the step
    the optimizer had in memory before the load (its ``dp_reshardable`` parameter state carries
    the step as a plain tensor, which dist_checkpointing does not read back): without this, a
    resumed run restarts Adam's bias correction from the wrong step.
    """
    for (opt, _), step in zip(_distributed(optimizer), steps, strict=True):
        if step is None:
            continue
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(float(step), dtype=torch.float32)
