"""Non-finite values, bad batches and bad configs (issue 6, item 4), on every built-in backend.

* Non-finite: an inf/NaN loss or gradient on ONE rank of 2 (every combination: inf loss with
  inf gradient, NaN gradient with a finite loss, NaN or inf loss with a finite gradient) makes
  every rank skip the step (``train_batch`` reports ``step_skipped = 1``, a non-finite grad
  norm), leaves params, optimizer state, step counter and LR bit-identical, and the next step
  is bit-identical to a twin engine's that never saw the poisoned steps; at DP=2 and, for
  megatron, TP=2 (where the loss is computed on each TP rank, so a rank-local NaN loss is only
  caught if the ranks agree), with and without deferred normalization.
* Bad batches (``_step_bad_batches.CASES``): ``train_batch`` raises a ``ValueError`` naming the
  field and the value, with a fix, and params / optimizer state / step / LR are bit-identical
  afterwards; every bad call made in the middle of a deferred accumulation window leaves that
  window intact (the step equals a twin's without the bad calls, bit for bit). At 2 ranks, a
  bad batch on one rank makes both ranks raise (the good rank names the bad rank, field and
  value) instead of leaving one rank waiting in a collective, and both engines stay usable.
* Bad configs fail at ``build_engine`` (general problems and each backend's own: TP vs heads,
  KV heads, PP vs layers, world size, context / sequence parallelism, not an HF directory),
  each naming the field, the value and a fix.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from engine_api import build_engine
from engine_api.config import EngineConfig
from engine_api.registry import get_engine_class
from tests.reliability import _step_bad_batches as bad
from tests.reliability._step_common import (
    local_batch,
    new_engine,
    reset_layout,
    run,
    run_window,
    snapshot,
    snapshot_diff,
    two_rank_layouts,
    worker_setup,
)
from tests.support.hf_utils import pg_loss

CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------- non-finite
def _poisoned_losses(rank: int) -> dict:
    """Loss functions that are non-finite on one rank only (the other rank's loss is normal)."""

    def inf_loss_and_grad(mb, out, norm):  # rank 0: loss and gradient inf/NaN
        loss, m = pg_loss(mb, out, norm)
        return (loss * math.inf if rank == 0 else loss), m

    def nan_grad_finite_loss(mb, out, norm):  # rank 1: NaN gradient, finite loss
        loss, m = pg_loss(mb, out, norm)
        if rank == 1:
            # 0 * sqrt(z - z) is 0 in the forward, but its gradient is 0 * inf = NaN.
            z = out["log_probs"].values().sum()
            loss = loss + 0.0 * torch.sqrt(z - z.detach())
        return loss, m

    def nan_loss_finite_grad(mb, out, norm):  # rank 0: NaN loss value, finite gradient
        loss, m = pg_loss(mb, out, norm)
        return (loss + math.nan if rank == 0 else loss), m

    def inf_loss_finite_grad(mb, out, norm):  # rank 1: inf loss value, finite gradient
        loss, m = pg_loss(mb, out, norm)
        return (loss + math.inf if rank == 1 else loss), m

    return {
        "inf loss+grad @rank0": inf_loss_and_grad,
        "nan grad @rank1": nan_grad_finite_loss,
        "nan loss @rank0": nan_loss_finite_grad,
        "inf loss @rank1": inf_loss_finite_grad,
    }


def _nonfinite_case(strategy, model_dir, extra) -> dict:
    engine, twin = new_engine(strategy, model_dir, *extra), new_engine(strategy, model_dir, *extra)
    for e in (engine, twin):
        run_window(e, local_batch(e, seed=0))
    before = snapshot(engine)
    cases = {}
    for name, loss_fn in _poisoned_losses(dist.get_rank()).items():
        engine.set_loss_fn(loss_fn)
        with engine.train_mode():
            m = engine.train_batch(local_batch(engine, seed=1))
        cases[name] = {"grad_norm": m["grad_norm"], "step_skipped": m["step_skipped"], "trace": snapshot_diff(before, snapshot(engine))}
    engine.set_loss_fn(pg_loss)
    nxt = {"engine": run_window(engine, local_batch(engine, seed=2)), "twin": run_window(twin, local_batch(twin, seed=2))}
    return {"cases": cases, "next": nxt, "next_diff": snapshot_diff(snapshot(engine), snapshot(twin))}


def _one_bad_rank(strategy, model_dir, extra) -> dict:
    """Rank 1's batch holds an out-of-vocabulary token; rank 0's is fine."""
    engine = new_engine(strategy, model_dir, *extra)
    run_window(engine, local_batch(engine, seed=0))
    before = snapshot(engine)
    batch = local_batch(engine, seed=1)
    if dist.get_rank() == 1:
        batch = bad.with_token(batch, row=0, position=1, token=bad.VOCAB)
    error = None
    try:
        with engine.train_mode():
            engine.train_batch(batch)
    except ValueError as exc:
        error = str(exc)
    trace = snapshot_diff(before, snapshot(engine))
    usable = run_window(engine, local_batch(engine, seed=1))  # both ranks go on training together
    return {"error": error, "trace": trace, "usable": math.isfinite(usable["grad_norm"])}


def two_rank_worker(rank, world, strategy, model_dir, layouts):
    worker_setup()
    out = {}
    for name, layout in layouts.items():
        for deferred in (False, True):
            extra = [*layout, "micro_batch_size=1", f"deferred_normalization={deferred}"]
            out[("nonfinite", name, deferred)] = _nonfinite_case(strategy, model_dir, extra)
        out[("one bad rank", name)] = _one_bad_rank(strategy, model_dir, layout)
        reset_layout(strategy)
    return out


# ----------------------------------------------------------------------------- bad batches
def _bad_batches(strategy, model_dir) -> dict:
    """Each bad batch through train_batch on a trained engine: the error and the state diff."""
    engines = {
        "plain": new_engine(strategy, model_dir),
        "budget": new_engine(strategy, model_dir, f"max_token_len_per_micro_batch={bad.TOKEN_BUDGET}"),
    }
    for e in engines.values():
        run_window(e, local_batch(e, seed=0))
    out = {}
    for name, build in bad.CASES.items():
        engine = engines["budget" if name == "longer than the token budget" else "plain"]
        batch, needles = build()
        before = snapshot(engine)
        error = None
        try:
            with engine.train_mode():
                engine.train_batch(batch)
        except ValueError as exc:
            error = str(exc)
        out[name] = {"error": error, "needles": needles, "trace": snapshot_diff(before, snapshot(engine))}
    return out


def _bad_calls_inside_a_window(strategy, model_dir) -> dict:
    """A deferred window of two good calls with every bad call made between them, vs a twin's
    window of the same two good calls."""
    extra = ["deferred_normalization=true", "micro_batch_size=1"]
    engine, twin = new_engine(strategy, model_dir, *extra), new_engine(strategy, model_dir, *extra)
    good = local_batch(engine, seed=3)
    raised = []
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_step(good[:2])
        for name, build in bad.CASES.items():
            if name == "longer than the token budget":
                continue  # needs a dynamic-batching engine; covered by _bad_batches
            try:
                engine.forward_backward_step(build()[0])
            except ValueError:
                raised.append(name)
        engine.forward_backward_step(good[2:])
        engine.optimizer_step()
        engine.lr_scheduler_step()
    run_window(twin, good, [2, good.batch_size[0] - 2])
    return {"raised": raised, "diff": snapshot_diff(snapshot(engine), snapshot(twin))}


# ----------------------------------------------------------------------------- bad configs
def unchecked_config(overrides: list[str]) -> EngineConfig:
    """An EngineConfig with ``overrides`` applied and no validation (as a program might build
    one by hand, backend options included), so that ``build_engine`` itself must catch the problem."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    general = [o for o in overrides if o.split("=")[0].split(".")[0] in fields]
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EngineConfig), OmegaConf.from_dotlist(general)))
    options = get_engine_class(config.strategy).options_class
    section = [o.split(".", 1)[1] for o in overrides if o.startswith(f"{options.config_section}.")]
    backend = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(options), OmegaConf.from_dotlist(section)))
    return dataclasses.replace(config, backend=backend)


# name -> (backends it applies to (None: all), overrides, needles). World size is 1 in the
# worker unless the case sets world_size (to isolate the problem it is about).
CONFIG_CASES = {
    "negative lr": (None, ["optim.lr=-1.0"], ["optim.lr = -1.0"]),
    "infinite lr": (None, ["optim.lr=inf"], ["optim.lr = inf", "not a finite number"]),
    "NaN clip_grad": (None, ["optim.clip_grad=nan"], ["optim.clip_grad = nan", "not a finite number"]),
    "NaN weight_decay": (None, ["optim.weight_decay=nan"], ["optim.weight_decay = nan", "not a finite number"]),
    "eps below fp32 range": (None, ["optim.eps=1e-46"], ["optim.eps = 1e-46", "smallest normal"]),
    "unknown loss_agg_mode": (None, ["loss_agg_mode=mean"], ["loss_agg_mode = 'mean'"]),
    "micro_batch_size 0": (None, ["micro_batch_size=0"], ["micro_batch_size = 0"]),
    "no model path": (None, ["model.path=null"], ["model.path = None"]),
    "not an HF directory": (None, ["model.path=<empty>"], ["has no config.json"]),
    "fsdp_size vs world": (("fsdp",), ["fsdp.fsdp_size=2"], ["fsdp.fsdp_size = 2", "does not divide the world size 1"]),
    "TP vs world": (("megatron",), ["megatron.tensor_model_parallel_size=2"], ["tensor_model_parallel_size = 2", "world size 1"]),
    "TP vs heads": (("megatron",), ["megatron.tensor_model_parallel_size=3", "world_size=3"], ["num_attention_heads = 4"]),
    "TP vs KV heads": (("megatron",), ["megatron.tensor_model_parallel_size=4", "world_size=4"], ["num_key_value_heads = 2"]),
    "PP vs layers": (("megatron",), ["megatron.pipeline_model_parallel_size=3", "world_size=3"], ["num_hidden_layers = 2"]),
    "PP x VPP vs layers": (
        ("megatron",),
        ["megatron.pipeline_model_parallel_size=2", "megatron.virtual_pipeline_model_parallel_size=2", "world_size=2"],
        ["= 4 does not divide the model's num_hidden_layers = 2"],
    ),
}
if not CUDA:  # both are fine on a GPU machine with Transformer-Engine
    CONFIG_CASES["sequence parallel without TE"] = (
        ("megatron",),
        ["megatron.tensor_model_parallel_size=2", "megatron.sequence_parallel=true", "world_size=2"],
        ["sequence_parallel = True", "Transformer-Engine"],
    )
    CONFIG_CASES["TE spec without CUDA"] = (("megatron",), ["megatron.layer_spec=te"], ["layer_spec = 'te'", "needs CUDA"])
    CONFIG_CASES["context parallel without TE"] = (
        ("megatron",),
        ["megatron.context_parallel_size=2", "world_size=2"],
        ["context_parallel_size = 2", "TEDotProductAttention", "ulysses_sequence_parallel_size"],
    )


def _bad_configs(strategy, model_dir, empty_dir) -> dict:
    out = {}
    base = [f"strategy={strategy}", f"model.path={model_dir}"]
    try:
        build_engine(unchecked_config(base))
        out["valid config"] = None
    except ValueError as exc:  # the control: the base config must build
        out["valid config"] = str(exc)
    for name, (backends, overrides, _) in CONFIG_CASES.items():
        if backends is not None and strategy not in backends:
            continue
        overrides = [o.replace("<empty>", empty_dir) for o in overrides]
        try:
            build_engine(unchecked_config([*base, *overrides]))
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def single_worker(rank, world, strategy, model_dir, empty_dir):
    worker_setup()
    return {
        "batches": _bad_batches(strategy, model_dir),
        "window": _bad_calls_inside_a_window(strategy, model_dir),
        "configs": _bad_configs(strategy, model_dir, empty_dir),
    }


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def single(backend, model_dir, tmp_path_factory):
    empty = tmp_path_factory.mktemp("not_hf")
    assert not os.listdir(empty)
    return run(single_worker, 1, backend, model_dir, str(empty))[0]


@pytest.fixture(scope="module")
def two_ranks(backend, model_dir):
    return run(two_rank_worker, 2, backend, model_dir, two_rank_layouts(backend))


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("deferred", [False, True], ids=["normal", "deferred"])
@pytest.mark.parametrize("case", list(_poisoned_losses(0)))
def test_non_finite_on_one_rank_skips_the_step_on_every_rank(two_ranks, backend, case, deferred):
    for layout in two_rank_layouts(backend):
        for rank, res in enumerate(two_ranks):
            r, label = res[("nonfinite", layout, deferred)]["cases"][case], f"{layout}/rank{rank}"
            assert r["step_skipped"] == 1.0, f"{label}: step not skipped ({r})"
            assert not math.isfinite(r["grad_norm"]), f"{label}: finite grad norm {r['grad_norm']} for a skipped step"
            assert r["trace"] == [], f"{label}: the skipped step changed {r['trace']}"


@pytest.mark.parametrize("deferred", [False, True], ids=["normal", "deferred"])
def test_step_after_skipped_steps_equals_a_run_without_them(two_ranks, backend, deferred):
    for layout in two_rank_layouts(backend):
        for rank, res in enumerate(two_ranks):
            r, label = res[("nonfinite", layout, deferred)], f"{layout}/rank{rank}"
            assert math.isfinite(r["next"]["twin"]["grad_norm"]), label
            assert r["next"]["engine"] == r["next"]["twin"], f"{label}: {r['next']}"
            assert r["next_diff"] == [], f"{label}: {r['next_diff']}"


def test_bad_batch_on_one_rank_stops_every_rank_cleanly(two_ranks, backend):
    for layout in two_rank_layouts(backend):
        errors = [res[("one bad rank", layout)]["error"] for res in two_ranks]
        assert errors[1] and f"token id {bad.VOCAB}" in errors[1] and "fix:" in errors[1], f"{layout}: {errors[1]}"
        # The good rank raises too, naming the bad rank and its error, instead of hanging.
        assert errors[0] and "rank 1" in errors[0] and f"token id {bad.VOCAB}" in errors[0], f"{layout}: {errors[0]}"
        for rank, res in enumerate(two_ranks):
            r = res[("one bad rank", layout)]
            assert r["trace"] == [], f"{layout}/rank{rank}: {r['trace']}"
            assert r["usable"], f"{layout}/rank{rank}: the engine could not train after the error"


@pytest.mark.parametrize("case", list(bad.CASES))
def test_bad_batch_raises_naming_field_and_value_before_any_state_change(single, case):
    r = single["batches"][case]
    assert r["error"] is not None, f"{case}: no ValueError"
    for needle in [*r["needles"], "fix:"]:
        assert needle in r["error"], f"{case}: {needle!r} not in {r['error']!r}"
    assert r["trace"] == [], f"{case}: state changed: {r['trace']}"


def test_bad_calls_inside_a_deferred_window_leave_it_intact(single):
    r = single["window"]
    assert r["raised"] == [c for c in bad.CASES if c != "longer than the token budget"]
    assert r["diff"] == [], r["diff"]


def test_valid_config_builds(single):
    assert single["configs"]["valid config"] is None, single["configs"]["valid config"]


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_fails_at_build_engine(single, backend, case):
    backends, _, needles = CONFIG_CASES[case]
    if backends is not None and backend not in backends:
        pytest.skip(f"{case} is a {'/'.join(backends)} setting")
    error = single["configs"][case]
    assert error is not None, f"build_engine accepted: {case}"
    for needle in [*needles, "fix:"]:
        assert needle in error, f"{case}: {needle!r} not in {error!r}"
