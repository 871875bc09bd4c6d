"""The conformance checks: each one a property of the ``BaseEngine`` contract, written against
the contract only (``build_engine``, the public methods, ``export_weights``), never against a
backend's internals.

Every check runs on every rank of one launch (``engine_api.conformance.runner``) and raises
:class:`CheckFailed` naming what differs and by how much; :class:`Skipped` when the backend
declares it does not take the check's setting (e.g. refuses ``model.head: value`` at
``build_engine``). Tolerances:

* against the independent HF reference (``fixtures``): max |diff| 1e-5 for per-token outputs
  (batched vs per-sequence forward differ in float summation order; measured up to 5e-7),
  relative 1e-6 for losses, grad norms and updated weights as one vector (fp32; measured
  2e-8 on every built-in backend, while a mis-scaled gradient moves the updated weights by
  ~1e-2 relative: AdamW eps 1e-3 keeps the update proportional to the gradient);
* engine against itself (abort, non-finite skip, bad batch, offload, resume): bit-exact;
* the LR: the reported one relative 1e-6 to the schedule's formula (``fx.lr_at``), the one a
  step applied (read from the weights) relative 1e-4 (fp32 rounding of ``p * (1 - lr)``).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_api.conformance import fixtures as fx


class CheckFailed(AssertionError):
    """A contract property does not hold."""


class Skipped(Exception):  # noqa: N818 - reads as the outcome
    """The backend refuses this check's setting at ``build_engine`` (reported, never counted as passed)."""


@dataclass(frozen=True)
class Env:
    """What a check knows: the backend, the layout settings, where the model and files live."""

    strategy: str
    overrides: tuple[str, ...]
    model_dir: str
    workdir: str
    rank: int
    world: int


@dataclass(frozen=True)
class Check:
    """One named property; ``phase`` 2 runs in a second, fresh launch (after phase 1)."""

    name: str
    fn: Callable[[Env], str]
    doc: str
    phase: int = 1


CHECKS: dict[str, Check] = {}


def check(name: str, phase: int = 1):
    def register(fn: Callable[[Env], str]) -> Callable[[Env], str]:
        CHECKS[name] = Check(name, fn, (fn.__doc__ or "").strip().splitlines()[0], phase)
        return fn

    return register


# ----------------------------------------------------------------------------- helpers
def new_engine(env: Env, *extra: str, mode: str = "token-mean", skip_on: str | None = None):
    """An initialised engine with the kit's settings, the layout overrides and ``extra``."""
    from engine_api import build_engine, load_config

    config = load_config(None, [*fx.engine_overrides(env.strategy, env.model_dir, mode), *env.overrides, *extra])
    try:
        engine = build_engine(config)
    except ValueError as exc:
        if skip_on is not None and skip_on in str(exc):
            raise Skipped(f"build_engine refuses {skip_on}: {str(exc).splitlines()[-1].strip()}") from None
        raise
    engine.init_model()
    engine.set_loss_fn(fx.loss_fn)
    return engine


def weights(engine) -> dict[str, torch.Tensor]:
    """Full weights by HF name (collective)."""
    return {k: v.detach().clone().cpu() for k, v in engine.export_weights()}


def window(engine, batch, calls: int = 1, inside: Callable[[], None] | None = None) -> dict:
    """One accumulation window on this rank's ``batch`` split into ``calls`` consecutive
    ``forward_backward_step`` calls, the optimizer step, and the LR step when it was taken;
    ``inside()`` runs last, still in ``train_mode``."""
    n = batch.batch_size[0]
    calls = min(calls, n)
    bounds = [round(i * n / calls) for i in range(calls + 1)]
    with engine.train_mode():
        engine.optimizer_zero_grad()
        losses = [engine.forward_backward_step(batch[a:b])[1] for a, b in zip(bounds, bounds[1:], strict=False)]
        norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step() if math.isfinite(norm) else None
        if inside is not None:
            inside()
    return {"losses": losses, "grad_norm": norm, "lr": lr}


def close(what: str, got: float, want: float, rtol: float = 1e-5) -> None:
    if not math.isclose(got, want, rel_tol=rtol, abs_tol=1e-12):
        raise CheckFailed(f"{what}: {got!r} vs {want!r} (relative {abs(got - want) / max(abs(want), 1e-30):.1e} > {rtol:g})")


def max_diff(jagged: torch.Tensor, rows: list[torch.Tensor]) -> float:
    return max(float((a.detach().cpu().float() - b).abs().max()) for a, b in zip(jagged.unbind(), rows, strict=True))


def same(what: str, got: dict, want: dict) -> None:
    """Bit-exact equality of two results (floats, lists and tensor dicts)."""
    if set(got) != set(want):
        raise CheckFailed(f"{what}: keys differ ({sorted(set(got) ^ set(want))[:4]})")
    for key in want:
        a, b = got[key], want[key]
        if isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                raise CheckFailed(f"{what}: {key} have other names ({sorted((set(a) if isinstance(a, dict) else set()) ^ set(b))[:4]})")
            bad = [k for k in b if not torch.equal(a[k], b[k])]
            if bad:
                raise CheckFailed(f"{what}: {key} differ ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        elif a != b and not (isinstance(b, float) and math.isnan(a) and math.isnan(b)):
            raise CheckFailed(f"{what}: {key} {a!r} vs {b!r}")


def _local(engine, seed: int = 0, **meta):
    return engine.shard_data(fx.make_test_batch(seed, **meta))


# ----------------------------------------------------------------------------- outputs
@check("hf_logprobs")
def hf_logprobs(env: Env) -> str:
    """Log-probs equal a per-sequence HF forward (packed + dynamic batching, padded + fixed micro-batches)."""
    hf = fx.hf_model(env.model_dir)
    worst = {}
    for name, extra in {
        "packed": ["max_token_len_per_micro_batch=16"],
        "padded": ["use_remove_padding=false", "micro_batch_size=3"],
    }.items():
        engine = new_engine(env, *extra)
        local = _local(engine)
        with engine.eval_mode():
            out = engine.infer_batch(local)
        if out is None:
            continue  # not an output rank (see BaseEngine.is_output_rank)
        want, _ = fx.hf_token_outputs(hf, local)
        worst[name] = max_diff(out["log_probs"], want)
        if worst[name] > 1e-5:
            raise CheckFailed(f"{name}: log-probs differ from HF by {worst[name]:.2e} (> 1e-5)")
    return ", ".join(f"{k} max|diff| {v:.1e}" for k, v in worst.items())


@check("temperature_entropy")
def temperature_entropy(env: Env) -> str:
    """Metadata temperature divides the logits, and calculate_entropy returns the entropy of those logits."""
    hf = fx.hf_model(env.model_dir)
    engine = new_engine(env)
    local = _local(engine, temperature=0.7, calculate_entropy=True)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is None:
        return "not an output rank"
    if "entropy" not in out.keys():
        raise CheckFailed("calculate_entropy=True returned no 'entropy'")
    want_lp, want_ent = fx.hf_token_outputs(hf, local, temperature=0.7)
    d_lp, d_ent = max_diff(out["log_probs"], want_lp), max_diff(out["entropy"], want_ent)
    if d_lp > 1e-5:
        raise CheckFailed(f"log-probs at temperature 0.7 differ from HF log_softmax(logits / 0.7) by {d_lp:.2e} (> 1e-5)")
    if d_ent > 1e-5:
        raise CheckFailed(f"entropy at temperature 0.7 differs from HF by {d_ent:.2e} (> 1e-5)")
    return f"log-probs max|diff| {d_lp:.1e}, entropy {d_ent:.1e}"


@check("value_head")
def value_head(env: Env) -> str:
    """model.head=value gives per-token values equal to HF token classification (head seeded by engine.seed)."""
    engine = new_engine(env, "model.head=value", skip_on="head")
    local = _local(engine)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is None:
        return "not an output rank"
    want = fx.hf_values(fx.hf_model(env.model_dir, "value", seed=engine.config.seed), local)
    d = max_diff(out["values"], want)
    if d > 1e-5:
        raise CheckFailed(f"values differ from HF token classification by {d:.2e} (> 1e-5)")
    return f"max|diff| {d:.1e}"


@check("export_names")
def export_names(env: Env) -> str:
    """export_weights yields every HF tensor by its HF name, equal to the HF checkpoint before
    training; with ``bucket_mb`` (a transfer hint) the same tensors in the same order."""
    engine = new_engine(env)
    got = weights(engine)
    want = fx.hf_model(env.model_dir).state_dict()
    if set(got) != set(want):
        raise CheckFailed(f"names differ: missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}")
    bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k].float(), want[k].float())]
    if bad:
        raise CheckFailed(f"{len(bad)} tensors differ from the HF checkpoint, e.g. {bad[:3]}")
    # A bucket far smaller than the model: several buckets, and tensors larger than one.
    bucketed = [(k, v.detach().clone().cpu()) for k, v in engine.export_weights(bucket_mb=0.01)]
    if [k for k, _ in bucketed] != list(got):
        raise CheckFailed("export_weights(bucket_mb=0.01) yields other names or another order than export_weights()")
    differ = [k for k, v in bucketed if v.dtype != got[k].dtype or v.shape != got[k].shape or not torch.equal(v, got[k])]
    if differ:
        raise CheckFailed(f"export_weights(bucket_mb=0.01) differs from export_weights() in {len(differ)} tensors, e.g. {differ[:3]}")
    return f"{len(got)} tensors, bit-exact; bucketed export identical"


def dropout_model(env: Env) -> str:
    """The kit's model with HF attention dropout on (``fx.DROPOUT``), built by the runner."""
    return os.path.join(env.workdir, fx.DROPOUT_MODEL)


@check("dropout")
def dropout(env: Env) -> str:
    """A model whose HF config sets attention_dropout applies it in train mode (two forwards of one batch differ) and not in eval mode (equals HF)."""
    engine = new_engine(env, f"model.path={dropout_model(env)}")
    local = _local(engine)
    with engine.train_mode():
        losses = []
        for _ in range(2):
            engine.optimizer_zero_grad()
            losses.append(engine.forward_backward_step(local)[1])
        engine.optimizer_zero_grad()  # abort: nothing is stepped
    if losses[0] == losses[1]:
        raise CheckFailed(
            f"attention_dropout={fx.DROPOUT} has no effect in train mode: two training forwards of one batch give loss {losses[0]!r} "
            "both times; fix: build the model with the HF config's dropout (the resume check relies on it to compare RNG state)"
        )
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is not None:
        d = max_diff(out["log_probs"], fx.hf_token_outputs(fx.hf_model(dropout_model(env)), local)[0])
        if d > 1e-5:
            raise CheckFailed(f"eval-mode log-probs of the dropout model differ from HF by {d:.2e} (> 1e-5): dropout applied in eval mode?")
    return f"train losses {losses[0]:.6f} vs {losses[1]:.6f}; eval equals HF"


# ----------------------------------------------------------------------------- the update
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
    """target_ids ([T] and [T, K] per sequence) give target_log_probs equal to HF's log-softmax at each position (no shift, the last position too)."""
    hf = fx.hf_model(env.model_dir)
    engine = new_engine(env, "max_token_len_per_micro_batch=16")
    worst = {}
    for label, k in (("[T]", None), ("[T, 3]", 3)):
        local = engine.shard_data(fx.make_target_batch(seed=2, k=k))
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
    return ", ".join(f"{k} max|diff| {v:.1e}" for k, v in worst.items())


@check("per_step_optim")
def per_step_optim(env: Env) -> str:
    """Two steps of a weighted target-token loss in loss_agg_mode=sum, AdamW's lr, betas, eps, weight decay and clipping reset by set_optim_hparams before each, the second in two calls, equal HF + torch AdamW set the same way; after reset_optimizer_state the next step equals a fresh AdamW's first from the current weights."""
    engine = new_engine(env, "max_token_len_per_micro_batch=16", mode="sum")
    worst = _target_steps(env, engine, lambda seeds: fx.reference_target_steps(env.model_dir, seeds), lambda: weights(engine), "weights")
    start = weights(engine)
    with engine.train_mode():
        engine.reset_optimizer_state()
    fresh = _target_steps(
        env,
        engine,
        lambda seeds: fx.reference_target_steps(env.model_dir, seeds, start=start),
        lambda: weights(engine),
        "weights (a step after reset_optimizer_state)",
        seeds=(12,),
    )
    return f"2 steps, worst weight error {worst:.1e}; after reset_optimizer_state {fresh:.1e}"


def _target_steps(
    env: Env, engine, reference: Callable, trained: Callable[[], dict], what: str, seeds: tuple[int, ...] = (10, 11)
) -> float:
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


# ----------------------------------------------------------------------------- state safety
@check("abort")
def abort(env: Env) -> str:
    """optimizer_zero_grad between calls aborts the window without a trace (bit-exact)."""
    a, b = new_engine(env), new_engine(env)
    with a.train_mode():
        a.optimizer_zero_grad()
        a.forward_backward_step(_local(a, seed=5))
        a.optimizer_zero_grad()  # abort
    got = {**window(a, _local(a)), "w": weights(a)}
    want = {**window(b, _local(b)), "w": weights(b)}
    same("window after an abort vs a fresh engine", got, want)
    return "bit-exact"


def _bad_batches(env: Env, engine) -> dict[str, object]:
    """Bad inputs; most on rank 0 only (every rank must still raise)."""
    from engine_api.batch import make_batch

    good = _local(engine)
    seqs = [s.clone() for s in good["input_ids"].unbind()]
    masks = list(good["loss_mask"].unbind())
    adv = list(good["advantages"].unbind())
    first = env.rank == 0
    oov = [s.clone() for s in seqs]
    oov[0][-1] = fx.VOCAB + 5
    long = [torch.randint(0, fx.VOCAB, (100,)), *seqs[1:]]
    long_masks = [torch.cat([torch.zeros(90), torch.ones(10)]), *masks[1:]]
    long_adv = [torch.zeros(100), *adv[1:]]
    cold = make_batch(seqs, loss_mask=masks, advantages=adv)
    if first:
        cold.set_non_tensor("temperature", 0.0)  # make_batch itself would refuse it
    return {
        "token id >= vocab on rank 0": make_batch(oov if first else seqs, loss_mask=masks, advantages=adv),
        "temperature 0 on rank 0": cold,
        "longer than the model on rank 0": make_batch(long, loss_mask=long_masks, advantages=long_adv)
        if first
        else make_batch(seqs, loss_mask=masks, advantages=adv),
        "no loss token anywhere": make_batch(seqs, loss_mask=[m * 0 for m in masks], advantages=adv),
    }


@check("bad_batch")
def bad_batch(env: Env) -> str:
    """A bad batch (on one rank) raises ValueError on every rank before any state changes, inside a pending window too."""
    a, b = new_engine(env), new_engine(env)
    before = weights(a)
    bad = _bad_batches(env, a)
    good = _local(a)
    half = good.batch_size[0] // 2 or 1
    with a.train_mode():
        a.optimizer_zero_grad()
        a.forward_backward_step(good[:half])
        for name, batch in bad.items():
            try:
                a.forward_backward_step(batch)
            except ValueError:
                continue
            raise CheckFailed(f"{name}: forward_backward_step did not raise ValueError")
        a.forward_backward_step(good[half:])
        norm_a = a.optimizer_step()
    with b.train_mode():
        b.optimizer_zero_grad()
        b.forward_backward_step(good[:half])
        b.forward_backward_step(good[half:])
        norm_b = b.optimizer_step()
    same("weights before the step", {"w": before}, {"w": weights(new_engine(env))})
    same("window with rejected bad calls vs without", {"grad_norm": norm_a, "w": weights(a)}, {"grad_norm": norm_b, "w": weights(b)})
    return f"{len(bad)} bad batches rejected, window intact (bit-exact)"


def _nan_loss_on(rank: int, env: Env):
    """A NaN loss on ``rank``: the NaN multiplies the loss, so it poisons the gradient too."""

    def loss(mb, out, norm):
        value, metrics = fx.loss_fn(mb, out, norm)
        return (value * float("nan") if env.rank == rank else value), metrics

    return loss


def _inf_loss_finite_grad_on(rank: int, env: Env):
    """An infinite loss on ``rank`` whose gradient stays finite: a detached inf term adds to
    the value and not to the graph (as a masked-out inf of a per-token term would). An engine
    that only looks at the grad norm steps on it."""

    def loss(mb, out, norm):
        value, metrics = fx.loss_fn(mb, out, norm)
        return (value + torch.tensor(float("inf")).to(value.device) if env.rank == rank else value), metrics

    return loss


@check("nonfinite_skip")
def nonfinite_skip(env: Env) -> str:
    """A NaN loss (NaN gradient) or an inf loss with a finite gradient, on one rank, skips the step on every rank, state untouched; the next step equals a run without it."""
    b = new_engine(env)
    want = {**window(b, _local(b)), "w": weights(b)}
    rank = env.world - 1
    for what, bad_loss in {
        "a NaN loss (NaN gradient)": _nan_loss_on,
        "an inf loss with a finite gradient": _inf_loss_finite_grad_on,
    }.items():
        a = new_engine(env)
        before = weights(a)
        a.set_loss_fn(bad_loss(rank, env))
        skipped = window(a, _local(a, seed=3))
        if math.isfinite(skipped["grad_norm"]):
            raise CheckFailed(f"optimizer_step returned {skipped['grad_norm']} for a window with {what} on rank {rank}: not skipped")
        same(f"weights after the step skipped for {what} on rank {rank}", {"w": weights(a)}, {"w": before})
        a.set_loss_fn(fx.loss_fn)
        same(f"step after one skipped for {what} vs a run without it", {**window(a, _local(a)), "w": weights(a)}, want)
    return "NaN loss and inf loss with finite grads: skipped on every rank, next step bit-exact"


def _big_weight_model(env: Env) -> str:
    """The kit's model with one MLP weight set to 4.0: a copy of its directory with that tensor
    changed in the safetensors file (one directory per rank, written beside and renamed: no
    barrier, and not HF's save_pretrained, which under torch.distributed writes on rank 0 only)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(env.workdir, f"model_big_weight_rank{env.rank}")
    if not os.path.isdir(path):
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(env.model_dir, tmp)
        name = "model.layers.0.mlp.down_proj.weight"
        for file in sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors")):
            tensors = load_file(os.path.join(tmp, file))
            if name in tensors:
                tensors[name][0, 0] = 4.0
                save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
        os.rename(tmp, path)
    return path


@check("nonfinite_update")
def nonfinite_update(env: Env) -> str:
    """A step whose finite gradient writes non-finite weights (weight decay 3e38 on a weight of 4) raises NonFiniteUpdateError on every rank; training, saving and exporting are refused until a load, which restores the saved weights."""
    from engine_api.optim import NonFiniteUpdateError

    engine = new_engine(env, f"model.path={_big_weight_model(env)}")
    window(engine, _local(engine))
    root = os.path.join(env.workdir, "ckpt_overflow")
    engine.save_checkpoint(root, global_step=1)
    good = weights(engine)
    # AdamW moves a weight by at most ~lr per step, and lr itself must fit in fp32, so what
    # overflows is the decoupled decay p * (1 - lr * wd): -3e38 times the model's weight of 4.
    engine.set_optim_hparams(lr=1.0, weight_decay=3e38)
    try:
        window(engine, _local(engine, seed=1))
    except NonFiniteUpdateError:
        pass
    else:
        raise CheckFailed("an optimizer step (finite gradient, lr 1, weight decay 3e38) left non-finite weights and raised nothing")
    refused = []
    for what, call in {
        "train_mode": lambda: engine.train_mode().__enter__(),
        "export_weights": lambda: next(iter(engine.export_weights())),
    }.items():
        try:
            call()
        except RuntimeError:
            refused.append(what)
    if len(refused) != 2:
        raise CheckFailed(f"after a non-finite update only {refused or 'nothing'} was refused (want train_mode and export_weights)")
    engine.load_checkpoint(root, del_local_after_load=False)
    same("weights after loading the checkpoint saved before the non-finite step", {"w": weights(engine)}, {"w": good})
    window(engine, _local(engine, seed=1))  # trains again
    return "NonFiniteUpdateError on every rank; train_mode and export refused; a load restores"


@check("unshard_order")
def unshard_order(env: Env) -> str:
    """unshard_data gives back the global batch's rows in their original order on every rank: the gathered log-probs equal HF's per sequence, row by row."""
    engine = new_engine(env)
    batch = fx.make_test_batch()
    with engine.eval_mode():
        out = engine.infer_batch(engine.shard_data(batch))
    gathered = engine.unshard_data(out) if out is not None else None
    if gathered is None:
        return "not an output rank"
    if gathered.batch_size[0] != batch.batch_size[0]:
        raise CheckFailed(f"unshard_data gave {gathered.batch_size[0]} rows for a batch of {batch.batch_size[0]}")
    lengths = [int(n) for n in gathered["log_probs"].offsets().diff()]
    if lengths != [int(n) for n in batch["input_ids"].offsets().diff()]:
        raise CheckFailed(
            f"unshard_data gave rows of lengths {lengths}, the batch's are {batch['input_ids'].offsets().diff().tolist()}: rows out of order"
        )
    want, _ = fx.hf_token_outputs(fx.hf_model(env.model_dir), batch)
    worst = max_diff(gathered["log_probs"], want)
    if worst > 1e-5:
        raise CheckFailed(f"the gathered log-probs differ from HF's for the same rows by {worst:.2e}: rows out of order or lost")
    return f"{batch.batch_size[0]} rows in order over {env.world} rank(s), max|diff| {worst:.1e}"


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


@check("frozen")
def frozen(env: Env) -> str:
    """engine.frozen=true: inference equals HF, every training call raises."""
    engine = new_engine(env, "frozen=true")
    local = _local(engine)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    if out is not None:
        d = max_diff(out["log_probs"], fx.hf_token_outputs(fx.hf_model(env.model_dir), local)[0])
        if d > 1e-5:
            raise CheckFailed(f"frozen engine's log-probs differ from HF by {d:.2e}")
    refused = []
    for what, call in {
        "train_mode": lambda: engine.train_mode().__enter__(),
        "forward_backward_step": lambda: engine.forward_backward_step(local),
        "optimizer_step": engine.optimizer_step,
        "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(env.workdir, "frozen_ckpt"), global_step=1),
    }.items():
        try:
            call()
        except (RuntimeError, ValueError):
            refused.append(what)
            continue
        raise CheckFailed(f"{what} on a frozen engine did not raise")
    return f"refused: {', '.join(refused)}"


@check("lora")
def lora(env: Env) -> str:
    """model.lora: refused unless the backend declares supports_lora; else two steps (per-step AdamW settings, the second in two calls) train the adapters as peft + torch AdamW do, adapters off == HF, on == peft, merged export == peft's merge."""
    from engine_api import build_engine, load_config
    from engine_api.registry import get_engine_class

    settings = ["model.lora.rank=4", "model.lora.alpha=8"]
    if not get_engine_class(env.strategy).supports_lora:
        config = load_config(None, [*fx.engine_overrides(env.strategy, env.model_dir), *env.overrides, *settings])
        try:
            build_engine(config)
        except ValueError as exc:
            if "model.lora.rank" in str(exc):
                return "refused at build_engine (the backend does not declare supports_lora)"
            raise
        raise CheckFailed("build_engine accepted model.lora.rank=4 on a backend that does not declare supports_lora")
    import peft

    engine = new_engine(env, *settings, "max_token_len_per_micro_batch=16", mode="sum")
    base = fx.hf_model(env.model_dir)
    untouched = weights(engine)
    trained = _lora_steps(env, engine)  # lora_B leaves its zero init: adapters on and off differ
    adapters = _adapters(engine)
    merged = weights(engine)
    off = _local(engine, seed=1, disable_adapters=True)
    on = _local(engine, seed=1)
    with engine.eval_mode():
        out_off, out_on = engine.infer_batch(off), engine.infer_batch(on)
    wrapped = peft.get_peft_model(fx.hf_model(env.model_dir), peft.LoraConfig(r=4, lora_alpha=8, target_modules=fx.peft_targets(adapters)))
    if peft.set_peft_model_state_dict(wrapped, adapters).unexpected_keys:
        raise CheckFailed("export_adapter_weights names are not peft's adapter names")
    wrapped.eval()
    if out_on is not None:
        d_off = max_diff(out_off["log_probs"], fx.hf_token_outputs(base, off)[0])
        d_on = max_diff(out_on["log_probs"], fx.hf_token_outputs(wrapped, on)[0])
        if d_off > 1e-5 or d_on > 1e-5:
            raise CheckFailed(f"log-probs: adapters off vs HF base {d_off:.2e}, adapters on vs peft {d_on:.2e} (> 1e-5)")
    want = wrapped.merge_and_unload().state_dict()
    if set(merged) != set(want):
        raise CheckFailed(f"merged export names differ from HF's: {sorted(set(merged) ^ set(want))[:4]}")
    err = fx.rel(merged, want)
    if err > 1e-6:
        raise CheckFailed(f"merged export differs from peft's merge_and_unload by {err:.2e} relative")
    if not any(not torch.equal(merged[k], untouched[k]) for k in want):
        raise CheckFailed("the step changed nothing")
    return f"{len(adapters)} adapter tensors; {trained}; merged export rel {err:.1e}"


@check("run_swap")
def run_swap(env: Env) -> str:
    """run_state / load_run_state: two runs taking turns on one engine (with LoRA when the backend supports it: the second's adapters drawn for another seed by reset_adapters), one swapped out with gradients pending, each give bit for bit the losses, grad norms and weights of a fresh engine serving that run alone; a state of another layout is refused, changing nothing."""
    from engine_api.registry import get_engine_class

    settings = ("model.lora.rank=4", "model.lora.alpha=8") if get_engine_class(env.strategy).supports_lora else ()

    def read(engine) -> dict[str, torch.Tensor]:
        return _adapters(engine) if settings else weights(engine)

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return float(x) if isinstance(x, torch.Tensor) else x

    def pending(engine, batch) -> float:
        with engine.train_mode():
            return float(engine.forward_backward_step(batch)[1])

    def finish(engine) -> float:
        with engine.train_mode():
            norm = engine.optimizer_step()
            engine.optimizer_zero_grad()
        return norm

    shared = new_engine(env, *settings, mode="sum")
    a, b = _local(shared, seed=1), _local(shared, seed=2)
    fresh = shared.run_state()
    # Run A: a step, then a forward_backward whose gradients are pending when B takes over.
    got_a = [window(shared, a), pending(shared, a)]
    state_a = shared.run_state()
    shared.load_run_state(fresh)
    if settings:  # run B starts from the adapters an engine built with seed 7 draws
        shared.reset_adapters(7)
    got_b = [window(shared, b), window(shared, b)]
    state_b = shared.run_state()
    shared.load_run_state(state_a)
    got_a += [finish(shared), window(shared, a)]
    weights_a = read(shared)
    shared.load_run_state(state_b)
    got_b.append(window(shared, b))
    weights_b = read(shared)
    for name, got, want_weights, calls in (
        ("run A", got_a, weights_a, lambda e: [window(e, a), pending(e, a), finish(e), window(e, a)]),
        ("run B", got_b, weights_b, lambda e: [window(e, b), window(e, b), window(e, b)]),
    ):
        alone = new_engine(env, *settings, *(("seed=7",) if settings and name == "run B" else ()), mode="sum")
        want = calls(alone)
        got, want = plain(got), plain(want)
        if got != want:
            raise CheckFailed(f"{name} interleaved with the other on one engine: {got} != alone: {want}")
        same(f"{name}'s weights after its calls (interleaved vs alone)", {"w": want_weights}, {"w": read(alone)})
        del alone
    other = new_engine(env, "model.lora.rank=2", "model.lora.alpha=8", mode="sum") if settings else None
    if other is not None:
        before = read(other)
        try:
            other.load_run_state(state_a)
        except ValueError:
            same("a refused load_run_state", {"w": read(other)}, {"w": before})
        else:
            raise CheckFailed("load_run_state took a rank-4 run's state into a rank-2 engine")
    what = "adapters; the second drawn for seed 7 by reset_adapters" if settings else "full weights"
    return f"2 runs interleaved == each alone, bit for bit ({what}); another layout refused"


def _lora_steps(env: Env, engine) -> str:
    """:func:`_target_steps` on a LoRA engine (rank 4, alpha 8) against peft + torch AdamW from
    the engine's initial adapters: the second step is the first in which ``lora_A`` gets a
    gradient (``lora_B`` starts at zero). A layout that refuses ``target_ids`` takes one step of
    the kit's loss instead, with no reference (said so)."""
    before = _adapters(engine)
    try:
        worst = _target_steps(
            env,
            engine,
            lambda seeds: fx.reference_target_steps(env.model_dir, seeds, lora=(before, 4, 8.0)),
            lambda: _adapters(engine),
            "adapters",
        )
    except Skipped as why:
        engine.set_loss_fn(fx.loss_fn)
        window(engine, _local(engine))
        return f"one step of the kit's loss ({why})"
    return f"2 steps == peft + AdamW (worst {worst:.1e})"


def _adapters(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in engine.export_adapter_weights()}


def _offload_stages(engine) -> list[tuple[str, dict, dict]]:
    """``(stage, engine.offloaded, expected)`` after init, in ``train_mode``, in ``eval_mode``
    and after it, for an engine built with ``offload.param`` and ``offload.optimizer``."""
    off, on = {"model": True, "optimizer": True}, {"model": False, "optimizer": False}
    stages = [("after init", engine.offloaded, off)]
    with engine.train_mode():
        stages.append(("in train_mode", engine.offloaded, on))
    with engine.eval_mode():
        stages.append(("in eval_mode", engine.offloaded, {"model": False, "optimizer": True}))
    stages.append(("after eval_mode", engine.offloaded, off))
    return stages


def _storages(engine) -> dict[str, list]:
    """Weak references to the distinct non-empty storages of ``engine.state_tensors`` per
    part (weak: holding them must not keep the memory alive), with their devices."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = {}
    for kind in ("model", "optimizer"):
        seen = {}
        for t in engine.state_tensors(kind):
            storage = t.untyped_storage()
            if storage.nbytes():
                seen.setdefault(storage.data_ptr(), (StorageWeakRef(storage), t.device))
        out[kind] = list(seen.values())
    return out


def _still_allocated(refs: list) -> int:
    """How many of ``refs`` still hold bytes (neither freed nor resized to 0 in place)."""
    alive = 0
    for ref, _ in refs:
        storage = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
        alive += storage is not None and storage.nbytes() > 0
        del storage
    return alive


def _check_released(engine, loaded: dict[str, list]) -> str:
    """After an offload of both parts: every storage seen while loaded is released, and no
    tensor of the engine's state holds bytes on the compute device (on a GPU)."""
    for kind, refs in loaded.items():
        if not refs:
            raise CheckFailed(
                f"engine.state_tensors({kind!r}) gave nothing after an optimizer step: the kit cannot see where the {kind} lives; "
                "fix: override BaseEngine.state_tensors to yield it"
            )
        alive = _still_allocated(refs)
        if alive:
            raise CheckFailed(
                f"after the offload, {alive} of the {len(refs)} {kind} storages used in train_mode are still allocated "
                f"(engine.offloaded says {engine.offloaded}): the offload freed nothing; fix: copy into host memory and release "
                "the loaded storage (kit.relocate_module / relocate_state, BaseEngine._move's default), on a CPU-only machine too"
            )
    for kind in ("model", "optimizer"):
        resident = [t.device for t in engine.state_tensors(kind) if t.device.type != "cpu" and t.untyped_storage().nbytes()]
        if resident:
            raise CheckFailed(f"after the offload, {len(resident)} {kind} tensors still hold bytes on {resident[0]}")
    return f"{len(loaded['model'])} model and {len(loaded['optimizer'])} optimizer storages released"


@check("offload")
def offload(env: Env) -> str:
    """offload.param/optimizer round trips through train/eval modes train bit-identically to
    no offload, an offload releases the storage the state used while loaded (on a CPU-only
    machine too), and ``engine.offloaded`` (the base's record) is right at each stage."""
    results, stages, released = [], [], ""
    for extra in (["offload.param=true", "offload.optimizer=true"], []):
        engine = new_engine(env, *extra)
        if extra:
            stages = _offload_stages(engine)
            loaded: dict[str, list] = {}
            steps = [window(engine, _local(engine, seed=0), inside=lambda e=engine, out=loaded: out.update(_storages(e)))]
            released = _check_released(engine, loaded)
            steps.append(window(engine, _local(engine, seed=1)))
        else:
            steps = [window(engine, _local(engine, seed=s)) for s in (0, 1)]
        with engine.eval_mode():
            out = engine.infer_batch(_local(engine))
        lp = None if out is None else out["log_probs"].values().detach().cpu().clone()
        with engine.train_mode():
            pass  # one more load / offload cycle
        results.append({"steps": steps, "w": weights(engine), "lp": lp})
    same(
        "training with offload vs without",
        {"steps": results[0]["steps"], "w": results[0]["w"]},
        {"steps": results[1]["steps"], "w": results[1]["w"]},
    )
    if results[1]["lp"] is not None and not torch.equal(results[0]["lp"], results[1]["lp"]):
        raise CheckFailed("inference after offload differs from inference without it")
    for stage, got, want in stages:
        if got != want:
            raise CheckFailed(f"engine.offloaded {stage} is {got}, want {want}")
    return f"2 steps + inference bit-exact; {released}; offload record right at every stage"


# ----------------------------------------------------------------------------- checkpoints
@check("save_before_first_step")
def save_before_first_step(env: Env) -> str:
    """A save before the first optimizer step changes nothing: 2 steps after it equal 2 steps without it, bit-exactly (and so do 2 steps after loading it in a fresh engine); a backend may refuse such a save with a ValueError instead."""
    plain = new_engine(env)
    want = {"steps": [window(plain, _local(plain, seed=s)) for s in (0, 1)], "w": weights(plain)}
    engine = new_engine(env)
    root = os.path.join(env.workdir, "ckpt_step0")
    try:
        engine.save_checkpoint(root, global_step=0)
    except ValueError as exc:
        saved = f"refused ({str(exc).splitlines()[0][:80]}...)"
    else:
        saved = "saved"
    same(
        f"2 steps after a save before the first step ({saved}) vs without it",
        {"steps": [window(engine, _local(engine, seed=s)) for s in (0, 1)], "w": weights(engine)},
        want,
    )
    if saved == "saved":
        loaded = new_engine(env)
        loaded.load_checkpoint(root, del_local_after_load=False)
        same(
            "2 steps after loading that checkpoint vs a fresh run",
            {"steps": [window(loaded, _local(loaded, seed=s)) for s in (0, 1)], "w": weights(loaded)},
            want,
        )
    return f"{saved}; training unchanged" + (", and after loading it" if saved == "saved" else "")


RESUME = ["optim.lr_schedule=cosine", "optim.warmup_steps=2", "optim.total_steps=10"]


def _resume_settings(env: Env) -> list[str]:
    """The resume checks' settings: a warmup + cosine schedule, on the dropout model, so the
    steps after the resume draw random numbers and match only if the RNG state was restored
    (the ``dropout`` check proves the dropout is live)."""
    return [*RESUME, f"model.path={dropout_model(env)}"]


def _ckpt_root(env: Env) -> str:
    return os.path.join(env.workdir, "ckpt")


@check("resume_save", phase=1)
def resume_save(env: Env) -> str:
    """(phase 1 of resume) 2 steps, save, 2 more steps: the record a fresh process must replay."""
    engine = new_engine(env, *_resume_settings(env))
    for s in (0, 1):
        window(engine, _local(engine, seed=s))
    engine.save_checkpoint(_ckpt_root(env), global_step=2)
    record = {"steps": [window(engine, _local(engine, seed=s)) for s in (2, 3)], "w": weights(engine)}
    if env.rank == 0:
        torch.save(record, os.path.join(env.workdir, "resume_record.pt"))
    return "saved global_step_2"


@check("resume", phase=2)
def resume(env: Env) -> str:
    """A fresh process loads the checkpoint and replays the next 2 steps bit-exactly (losses, grad norms, LR, weights), with dropout: RNG restored."""
    record_path = os.path.join(env.workdir, "resume_record.pt")
    if not os.path.exists(record_path):
        raise CheckFailed("no record from phase 1 (resume_save failed or did not run)")
    want = torch.load(record_path, weights_only=True)
    engine = new_engine(env, *_resume_settings(env))
    step = engine.load_checkpoint(_ckpt_root(env), del_local_after_load=False)
    if step != 2:
        raise CheckFailed(f"load_checkpoint returned step {step}, saved at 2")
    got = {"steps": [window(engine, _local(engine, seed=s)) for s in (2, 3)], "w": weights(engine)}
    same("resumed run vs uninterrupted run", got, want)
    return "steps 3-4 bit-exact"


SENTINEL = "code_ran.txt"


def tamper(workdir: str) -> dict[str, str]:
    """Make tampered copies of phase 1's checkpoint (in the launcher, between the phases):
    one bit flipped in the largest file; the largest file replaced by a pickle that runs code
    when unpickled, with the manifest and marker forged to vouch for it. Returns name -> path."""
    import json
    import pickle

    from engine_api import ckpt_layout
    from engine_api.ckpt_integrity import write_manifest

    src = ckpt_layout.latest_checkpoint(os.path.join(workdir, "ckpt"))
    if src is None:
        return {}
    out = {}
    for name in ("bit_flip", "code_pickle"):
        dst = os.path.join(workdir, f"tampered_{name}")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        files = [os.path.join(r, f) for r, _, fs in os.walk(dst) for f in fs if f not in (ckpt_layout.MARKER, "manifest.json")]
        target = max(files, key=os.path.getsize)
        if name == "bit_flip":
            with open(target, "r+b") as f:
                f.seek(os.path.getsize(target) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0x01]))
        else:
            with open(target, "wb") as f:
                pickle.dump(_RunsCode(os.path.join(workdir, SENTINEL)), f)
            marker_path = os.path.join(dst, ckpt_layout.MARKER)
            with open(marker_path) as f:
                marker = json.load(f)
            marker["manifest_sha256"] = write_manifest(dst, exclude=(ckpt_layout.MARKER,))
            with open(marker_path, "w") as f:
                json.dump(marker, f)
        out[name] = dst
    return out


class _RunsCode:
    """Unpickling this writes a file: the payload of the code-running checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (_write_sentinel, (self.path,))


def _write_sentinel(path: str) -> None:
    with open(path, "w") as f:
        f.write("a checkpoint ran code on load\n")


@check("tampered_checkpoint", phase=2)
def tampered_checkpoint(env: Env) -> str:
    """A bit-flipped or code-carrying checkpoint is refused with ValueError, runs no code, changes no state."""
    engine = new_engine(env, *_resume_settings(env))
    before = weights(engine)
    refused = []
    for name in ("bit_flip", "code_pickle"):
        path = os.path.join(env.workdir, f"tampered_{name}")
        if not os.path.isdir(path):
            raise CheckFailed(f"no tampered copy {name} (phase 1's checkpoint is missing)")
        try:
            engine.load_checkpoint(path, del_local_after_load=False)
        except ValueError:
            refused.append(name)
        else:
            raise CheckFailed(f"load_checkpoint accepted the {name} checkpoint")
        if os.path.exists(os.path.join(env.workdir, SENTINEL)):
            raise CheckFailed(f"loading the {name} checkpoint ran code from it")
    same("weights after refused loads", {"w": weights(engine)}, {"w": before})
    return f"refused: {', '.join(refused)}; no code ran; state unchanged"
