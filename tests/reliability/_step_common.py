"""Shared pieces of the reliability suite (issue 6): the backends it covers, engines, training
windows, and bit-exact snapshots of an engine's training state.

Every scenario runs in spawned ranks (``tests.support.launch``) for every backend in
``BACKENDS``: megatron's parallel state is process-global, and spawning keeps the FSDP runs
and the memory measurements out of the pytest process as well. A backend added to the
registry's built-ins is covered by the whole suite without edits here (give it a 2-rank
layout in ``TWO_RANK_LAYOUTS`` if it has more than data parallelism).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from engine_api.registry import builtin_engines
from tests.support.hf_utils import engine_for, full_params, make_test_batch
from tests.support.launch import run_distributed

BACKENDS = tuple(builtin_engines())

# 2-rank layouts per backend; the default is plain data parallelism.
TWO_RANK_LAYOUTS = {
    "megatron": {"dp2": [], "tp2": ["megatron.tensor_model_parallel_size=2"]},
}

# Every reliability engine: AdamW eps 1e-3 so that parameters after a step move with the
# gradient element by element (see engine_api/conformance/fixtures.py, engine_overrides: with eps 1e-8 the
# first Adam step is a sign function and would hide a mis-scaled gradient), no clipping (it
# would rescale a wrong gradient back to norm 1), and an LR that changes every step (so a
# scheduler that advanced when it should not is visible).
COMMON = ["optim.eps=1e-3", "optim.clip_grad=null", "optim.lr_schedule=cosine", "optim.warmup_steps=2", "optim.total_steps=20"]


def run(fn, world: int, *args, timeout: float = 600, env: dict | None = None, fresh: bool = False):
    """``run_distributed``: ``fn`` on the long-lived world of ``world`` ranks, or on new ranks
    (``fresh``) where the process itself is measured or its group replaced."""
    return run_distributed(fn, world, *args, timeout=timeout, env=env, fresh=fresh)


def worker_setup() -> None:
    """First call of every spawned worker: one intra-op thread. The models are tiny, and on
    a 2-core CI machine running 2 ranks (or other tests) extra threads only contend: a
    training window measured 0.05 s with one thread and 1.1 s with two under load."""
    torch.set_num_threads(1)


def two_rank_layouts(strategy: str) -> dict[str, list[str]]:
    """The 2-rank layouts a backend is tested at."""
    return TWO_RANK_LAYOUTS.get(strategy, {"dp2": []})


def new_engine(strategy: str, model_dir: str, *overrides: str):
    """An initialised engine with :data:`COMMON` settings and the test policy loss."""
    return engine_for(model_dir, *COMMON, *overrides, strategy=strategy)


def reset_layout(strategy: str) -> None:
    """Tear down process-global parallel state so the next engine may use another layout."""
    if strategy == "megatron":
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def run_window(engine, batch, sizes=None, zero_grad: bool = True) -> dict:
    """One accumulation window on this rank's ``batch``: optional zero_grad, one
    forward_backward call per entry of ``sizes`` (consecutive rows; default one call),
    optimizer step, and the LR step when the step was taken. Returns the per-call losses,
    the grad norm and the LR."""
    sizes = sizes or [batch.batch_size[0]]
    assert sum(sizes) == batch.batch_size[0], (sizes, batch.batch_size)
    with engine.train_mode():
        if zero_grad:
            engine.optimizer_zero_grad()
        losses, start = [], 0
        for n in sizes:
            losses.append(engine.forward_backward_step(batch[start : start + n])[1])
            start += n
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step() if math.isfinite(grad_norm) else None
    return {"losses": losses, "grad_norm": grad_norm, "lr": lr}


def local_batch(engine, seed: int = 0):
    """This rank's shard of the global test batch of ``seed``."""
    return engine.shard_data(make_test_batch(seed=seed))


# ----------------------------------------------------------------------------- snapshots
def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a backend's optimizer (megatron wraps and chains them)."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [t for o in optimizer.chained_optimizers for t in torch_optimizers(o)]
    return torch_optimizers(getattr(optimizer, "optimizer", None))


def snapshot(engine) -> dict:
    """A bit-exact copy of the training state: full params by HF name (collective), this
    rank's optimizer state (every tensor, e.g. Adam moments and step counts, in parameter
    order) and learning rates, and the engine's step counter.

    Read inside ``train_mode`` so that offloaded state is loaded first (megatron frees the
    storage of offloaded tensors: reading it outside would read freed memory)."""
    optim, lrs = [], []
    with engine.train_mode():
        for opt in torch_optimizers(engine.optimizer):
            for group in opt.param_groups:
                lrs.append(group["lr"])
                for p in group["params"]:
                    for key, value in sorted(opt.state.get(p, {}).items()):
                        if isinstance(value, torch.Tensor):
                            value = (value.to_local() if isinstance(value, DTensor) else value).detach().clone().cpu()
                        optim.append((key, value))
    return {"params": full_params(engine), "optim": optim, "lr": lrs, "step": engine.global_step}


def snapshot_diff(a: dict, b: dict) -> list[str]:
    """What differs (bit for bit) between two snapshots; empty when identical."""
    out = []
    if a["step"] != b["step"]:
        out.append(f"step {a['step']} vs {b['step']}")
    if a["lr"] != b["lr"]:
        out.append(f"lr {a['lr']} vs {b['lr']}")
    if set(a["params"]) != set(b["params"]):
        out.append("param names differ")
    out += [f"param {k}" for k in a["params"] if k in b["params"] and not torch.equal(a["params"][k], b["params"][k])]
    if len(a["optim"]) != len(b["optim"]):
        out.append(f"optimizer state has {len(a['optim'])} vs {len(b['optim'])} entries")
    for i, ((ka, va), (kb, vb)) in enumerate(zip(a["optim"], b["optim"], strict=False)):
        same = torch.equal(va, vb) if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) else va == vb
        if ka != kb or not same:
            out.append(f"optimizer state entry {i} ({ka})")
    return out


def rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative L2 difference of two full parameter sets (one vector)."""
    a = torch.cat([got[k].flatten().double() for k in want])
    b = torch.cat([v.flatten().double() for v in want.values()])
    return float((a - b).norm() / b.norm())
