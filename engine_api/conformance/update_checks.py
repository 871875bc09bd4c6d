"""The conformance checks of the optimizer step: one step equals an independent HF + torch AdamW
step for every micro-batching, packing, split-call and DP layout in all four aggregation modes;
what the Tinker API adds (log-probs of arbitrary ``target_ids``, AdamW's settings reset per step,
``reset_optimizer_state``); and the LR each step applies and reports following the schedule,
across a save and load too."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed, Env, Skipped, _local, check, close, max_diff, new_engine, weights, window
from engine_api.logprobs import TOPK_IDS, TOPK_LOG_PROBS, TOPK_META

UPDATE_RTOL = 1e-6
VARIANTS = {
    "one-micro-batch": ([], 1),
    "mbs=1": (["micro_batch_size=1"], 1),
    "dynamic": (["max_token_len_per_micro_batch=16"], 1),
    "padded-mbs=2": (["use_remove_padding=false", "micro_batch_size=2"], 1),
    "split3-deferred": (["deferred_normalization=true", "micro_batch_size=1"], 3),
}


@check("update_invariance")
def update_invariance(env: Env) -> str:
    """One optimizer step equals an independent HF step for every micro-batching, packing, split-call and DP layout, in all 4 modes."""
    worst = 0.0
    for mode in fx.MODES:
        ref = fx.reference_step(env.model_dir, mode)
        for name, (extra, calls) in VARIANTS.items():
            engine = new_engine(env, *extra, mode=mode)
            result = window(engine, _local(engine), calls)
            label = f"{mode}/{name}/{env.world} rank(s)"
            if calls == 1:
                close(f"{label}: loss", result["losses"][0], ref["loss"], UPDATE_RTOL)
            close(f"{label}: pre-clip grad norm", result["grad_norm"], ref["grad_norm"], UPDATE_RTOL)
            err = fx.rel(weights(engine), ref["after"])
            worst = max(worst, err)
            if err > UPDATE_RTOL:
                raise CheckFailed(f"{label}: updated weights differ from the reference step by {err:.2e} relative (> {UPDATE_RTOL:g})")
    return f"{len(fx.MODES) * len(VARIANTS)} steps, worst weight error {worst:.1e}"


# ----------------------------------------------------------------------------- the Tinker API's needs
REFUSES_TARGETS = "arbitrary target log-probs are not computed"


def _targets_or_skip(call: Callable[[], object]) -> object:
    """``call()``; a layout that refuses ``target_ids`` as documented (``StepSpec.scores_targets``)
    is reported as skipped with the engine's reason, never as passed."""
    try:
        return call()
    except ValueError as exc:
        if REFUSES_TARGETS in str(exc):
            raise Skipped(f"the engine refuses target_ids here: {exc}") from None
        raise


@check("target_logprobs")
def target_logprobs(env: Env) -> str:
    """target_ids ([T] and [T, K] per sequence) give target_log_probs equal to HF's log-softmax at each position (no shift, the last position too); metadata return_topk gives each position's top-k ids and log-probs as HF's."""
    hf = fx.hf_model(env.model_dir)
    engine = new_engine(env, "max_token_len_per_micro_batch=16")
    worst = {}
    for label, k in (("[T]", None), ("[T, 3]", 3)):
        local = engine.shard_data(fx.make_target_batch(seed=2, k=k))
        if k is None:
            local.set_non_tensor(TOPK_META, TOPK)
        with engine.eval_mode():
            out = _targets_or_skip(lambda local=local: engine.infer_batch(local))
        if out is None:
            continue  # not an output rank
        got = out["target_log_probs"]
        if got.values().shape != local["target_ids"].values().shape:
            raise CheckFailed(
                f"{label}: target_log_probs has shape {tuple(got.values().shape)}, target_ids {tuple(local['target_ids'].values().shape)}"
            )
        worst[label] = max_diff(got, fx.hf_target_log_probs(hf, local))
        if worst[label] > 1e-5:
            raise CheckFailed(f"{label} targets: log-probs differ from HF by {worst[label]:.2e} (> 1e-5)")
        if k is None:
            worst[f"top-{TOPK}"] = _topk_diff(hf, local, out)
    return ", ".join(f"{k} max|diff| {v:.1e}" for k, v in worst.items())


TOPK = 4


def _topk_diff(hf, local, out) -> float:
    """The engine's ``topk_ids`` / ``topk_log_probs`` against HF's: the values against HF's top-k
    values, and HF's log-probs at the engine's ids against the engine's values (so a near-tie
    listed in the other order still passes; a wrong id does not)."""
    if TOPK_IDS not in out.keys() or TOPK_LOG_PROBS not in out.keys():
        raise CheckFailed(f"{TOPK_META}={TOPK}: the outputs lack {TOPK_IDS} / {TOPK_LOG_PROBS} (got {sorted(out.keys())})")
    worst = 0.0
    with torch.no_grad():
        rows = zip(local["input_ids"].unbind(), out[TOPK_IDS].unbind(), out[TOPK_LOG_PROBS].unbind(), strict=True)
        for ids, top_ids, top_lp in rows:
            if top_ids.shape != (ids.shape[0], TOPK) or top_ids.dtype.is_floating_point:
                raise CheckFailed(
                    f"{TOPK_IDS}: shape {tuple(top_ids.shape)} dtype {top_ids.dtype}, want ({ids.shape[0]}, {TOPK}) integer ids"
                )
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), -1)
            worst = max(worst, float((logp.topk(TOPK, -1).values - top_lp.float()).abs().max()))
            worst = max(worst, float((logp.gather(-1, top_ids.long()) - top_lp.float()).abs().max()))
    if worst > 1e-5:
        raise CheckFailed(f"{TOPK_META}={TOPK}: top-k log-probs differ from HF's by {worst:.2e} (> 1e-5)")
    return worst


@check("per_step_optim")
def per_step_optim(env: Env) -> str:
    """Two steps of a weighted target-token loss in loss_agg_mode=sum, AdamW's lr, betas, eps, weight decay and clipping reset by set_optim_hparams before each, the second in two calls, equal HF + torch AdamW set the same way; after reset_optimizer_state the next step equals a fresh AdamW's first from the current weights."""
    engine = new_engine(env, "max_token_len_per_micro_batch=16", mode="sum")
    worst = target_steps(env, engine, lambda seeds: fx.reference_target_steps(env.model_dir, seeds), lambda: weights(engine), "weights")
    start = weights(engine)
    with engine.train_mode():
        engine.reset_optimizer_state()
    fresh = target_steps(
        env,
        engine,
        lambda seeds: fx.reference_target_steps(env.model_dir, seeds, start=start),
        lambda: weights(engine),
        "weights (a step after reset_optimizer_state)",
        seeds=(12,),
    )
    return f"2 steps, worst weight error {worst:.1e}; after reset_optimizer_state {fresh:.1e}"


def target_steps(env: Env, engine, reference: Callable, trained: Callable[[], dict], what: str, seeds: tuple[int, ...] = (10, 11)) -> float:
    """Steps (one per seed) of :func:`fixtures.target_loss_fn` on ``engine`` (built with
    ``mode="sum"``), each with :data:`fixtures.STEP_HPARAMS` set by ``set_optim_hparams`` first,
    the second in two calls, no LR scheduler step (the rate is set per step). After each, loss, pre-clip grad norm
    and ``trained()`` (``what``) are compared with ``reference(seeds)[i]`` (computed once, after
    the first call: a layout that refuses ``target_ids`` raises :class:`Skipped` before it).
    Returns the worst relative error of ``trained()``."""
    engine.set_loss_fn(fx.target_loss_fn)
    ref, worst = None, 0.0
    for i, (seed, hp) in enumerate(zip(seeds, fx.STEP_HPARAMS[: len(seeds)], strict=True)):
        engine.set_optim_hparams(**hp)
        local = engine.shard_data(fx.make_target_batch(seed))
        n = local.batch_size[0]
        parts = [local] if i == 0 else [local[: n // 2], local[n // 2 :]]
        with engine.train_mode():
            engine.optimizer_zero_grad()
            loss = sum(_targets_or_skip(lambda part=part: engine.forward_backward_step(part))[1] for part in parts)
            norm = engine.optimizer_step()
        ref = ref or reference(seeds)
        label = f"step {i + 1} ({len(parts)} call(s), {env.world} rank(s))"
        close(f"{label}: loss", loss, ref[i]["loss"], UPDATE_RTOL)
        close(f"{label}: pre-clip grad norm", norm, ref[i]["grad_norm"], UPDATE_RTOL)
        got = trained()
        differ = sorted(set(ref[i]["after"]) ^ set(got))
        if differ:
            raise CheckFailed(f"{label}: the names of the engine's {what} differ from the reference's: {differ[:4]}")
        err = fx.rel(got, ref[i]["after"])
        worst = max(worst, err)
        if err > UPDATE_RTOL:
            raise CheckFailed(f"{label}: updated {what} differ from the reference by {err:.2e} relative (> {UPDATE_RTOL:g})")
    return worst


# Warmup + cosine decay with a floor; weight decay 1 makes the applied LR visible (below).
LR_WARMUP, LR_TOTAL, LR_MIN_RATIO, LR_DECAY = 2, 6, 0.1, 1.0
LR_SETTINGS = (
    "optim.lr_schedule=cosine",
    f"optim.warmup_steps={LR_WARMUP}",
    f"optim.total_steps={LR_TOTAL}",
    f"optim.min_lr_ratio={LR_MIN_RATIO}",
    f"optim.weight_decay={LR_DECAY}",
)


def _zero_loss(mb, out, norm):
    """The kit's loss times 0: every gradient is exactly 0, so AdamW's moments stay 0 and its
    step is ``p *= 1 - lr * weight_decay`` alone, which tells the LR the step applied."""
    value, metrics = fx.loss_fn(mb, out, norm)
    return value * 0.0, metrics


def _lr_steps(env: Env, engine, steps: range) -> list[str]:
    """Run ``steps`` (0-based optimizer step numbers) with :func:`_zero_loss`; compare the LR
    each step applied (read from the weights) and the LR ``lr_scheduler_step`` reports (the
    next step's) with :func:`fx.lr_at`. Returns the compared values for the report."""
    seen = []
    for k in steps:
        before = weights(engine)
        reported = window(engine, _local(engine, seed=k))["lr"]
        after = weights(engine)
        b = torch.cat([before[n].flatten().double() for n in before])
        a = torch.cat([after[n].flatten().double() for n in before])
        applied = float(1.0 - a.dot(b) / b.dot(b)) / LR_DECAY  # least squares of a = (1 - lr * wd) * b
        want = fx.lr_at(k, fx.LR, LR_WARMUP, LR_TOTAL, LR_MIN_RATIO)
        close(f"LR applied by optimizer step {k + 1} (read from the weight decay of a zero-gradient step)", applied, want, 1e-4)
        if reported is None:
            raise CheckFailed(f"optimizer step {k + 1} (zero gradient, finite norm) was skipped")
        close(
            f"LR reported by lr_scheduler_step after step {k + 1} (the next step's)",
            reported,
            fx.lr_at(k + 1, fx.LR, LR_WARMUP, LR_TOTAL, LR_MIN_RATIO),
            1e-6,
        )
        seen.append(f"{applied:.5f}")
    return seen


@check("lr_schedule")
def lr_schedule(env: Env) -> str:
    """The LR each optimizer step applies, and the one lr_scheduler_step reports, follow warmup + cosine decay from the config, also after save and load."""
    engine = new_engine(env, *LR_SETTINGS)
    engine.set_loss_fn(_zero_loss)
    seen = _lr_steps(env, engine, range(3))
    root = os.path.join(env.workdir, "lr_ckpt")
    engine.save_checkpoint(root, global_step=3)
    seen += _lr_steps(env, engine, range(3, 5))
    resumed = new_engine(env, *LR_SETTINGS)
    resumed.set_loss_fn(_zero_loss)
    if resumed.load_checkpoint(root, del_local_after_load=False) != 3:
        raise CheckFailed("load_checkpoint did not return the saved step 3")
    _lr_steps(env, resumed, range(3, 5))
    return f"applied LRs {', '.join(seen)} as scheduled; after load, steps 4-5 continue it"
