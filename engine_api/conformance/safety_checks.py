"""The conformance checks that failed, refused or aborted calls leave no trace: an aborted window,
a bad batch on one rank (every rank raises before any state changes), a non-finite loss on one
rank (every rank skips the step), a step that overflows the weights (refused until a load), and
a frozen engine (inference only)."""

from __future__ import annotations

import math
import os
import shutil

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed, Env, _local, check, max_diff, new_engine, same, weights, window


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
