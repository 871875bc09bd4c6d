"""The conformance kit's mixed-precision check (``model.dtype: bfloat16``), on every layout the
kit runs: what a user of bf16 training relies on, written against the contract only.

* The fp32 HF weights reach the engine's trained weights exactly (``export_weights`` before any
  step equals the checkpoint bit for bit, in fp32): a backend that rounds them to bf16 before
  the first step loses up to 2^-9 of every weight (the anchors' fp32 main parameters keep it).
* The forward really computes in bf16: its log-probs are off the fp32 HF forward by more than
  fp32 reordering noise could be (``MIN_HALF_DIFF``), and no further off than a bound derived
  from HF's own bf16 forward of the same model (``HALF_FACTOR`` x its deviation from fp32,
  plus ``HALF_SLACK``): different bf16 kernels round differently, but by the same order.
* One optimizer step moves the weights as the fp32 reference step does (``fixtures.reference_step``),
  as one vector within ``UPDATE_RTOL_HALF`` relative: bf16 gradients carry ~2^-8 relative noise
  per element, which AdamW (eps 1e-3: the update is Lipschitz in the gradient) passes on.
* A save and a load in the same process restore the fp32 weights bit for bit, and the next step
  after the load is the step taken before it, bit for bit (the fp32 mains and the optimizer
  moments round-trip; a checkpoint of the bf16 parameters alone would not).

Tolerances measured on the kit's model (``fixtures.build_model``), token-mean: see
``docs/guarantees.md``. A backend that refuses ``model.dtype=bfloat16`` at ``build_engine`` is
reported skipped with its reason.
"""

from __future__ import annotations

import os

import torch

from engine_api.conformance import fixtures as fx
from engine_api.conformance.checks import CheckFailed, Env, _local, check, new_engine, same, weights, window

HALF = "model.dtype=bfloat16"
MIN_HALF_DIFF = 5e-5  # mean |diff| to fp32 HF: fp32 reordering noise is ~1e-7, the bf16 engines ~5e-4
HALF_FACTOR, HALF_SLACK = 4.0, 1e-2
UPDATE_RTOL_HALF = 0.05


def _hf_half_deviation(model_dir: str, local) -> tuple[list[torch.Tensor], float]:
    """fp32 HF log-probs of ``local`` and the mean |diff| of HF's own bf16 forward to them."""
    hf = fx.hf_model(model_dir)
    want, _ = fx.hf_token_outputs(hf, local)
    half, _ = fx.hf_token_outputs(hf.to(torch.bfloat16), local)
    diffs = torch.cat([(a.float() - b).abs() for a, b in zip(half, want, strict=True)])
    return want, float(diffs.mean())


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k].double() - before[k].double() for k in before}


@check("mixed_precision")
def mixed_precision(env: Env) -> str:
    """bf16: HF weights reach the trained weights exactly, the forward computes in bf16, one step follows the fp32 reference, save/load is bit-exact."""
    engine = new_engine(env, HALF, skip_on="model.dtype")
    ref = fx.reference_step(env.model_dir, "token-mean")
    start = weights(engine)
    off = [k for k in ref["before"] if k in start and (start[k].dtype != torch.float32 or not torch.equal(start[k], ref["before"][k]))]
    if off:
        raise CheckFailed(f"export_weights before the first step is not the fp32 HF checkpoint bit for bit: {', '.join(off[:4])}")
    local = _local(engine)
    with engine.eval_mode():
        out = engine.infer_batch(local)
    detail = []
    if out is not None:
        want, hf_dev = _hf_half_deviation(env.model_dir, local)
        diffs = torch.cat([(a.detach().cpu().float() - b).abs() for a, b in zip(out["log_probs"].unbind(), want, strict=True)])
        dev = float(diffs.mean())
        if dev < MIN_HALF_DIFF:
            raise CheckFailed(
                f"log-probs under {HALF} are within {dev:.1e} (mean) of the fp32 HF forward: the model computes in fp32, "
                f"not bf16 (bf16 rounding moves them by ~{hf_dev:.0e})"
            )
        bound = HALF_FACTOR * hf_dev + HALF_SLACK
        if dev > bound:
            raise CheckFailed(
                f"log-probs under {HALF} are {dev:.2e} (mean) off fp32 HF; HF's own bf16 forward is {hf_dev:.2e} off (bound {bound:.2e})"
            )
        detail.append(f"log-probs {dev:.1e} off fp32 HF (HF bf16 {hf_dev:.1e})")
    window(engine, local)
    stepped = weights(engine)
    err = fx.rel(_delta(stepped, start), _delta(ref["after"], ref["before"]))
    if err > UPDATE_RTOL_HALF:
        raise CheckFailed(f"the bf16 step's update differs from the fp32 reference update by {err:.2e} relative (> {UPDATE_RTOL_HALF:g})")
    root = os.path.join(env.workdir, "ckpt_bf16")
    engine.save_checkpoint(root, global_step=1)
    record = {"steps": [window(engine, _local(engine, seed=1))], "w": weights(engine)}
    engine.load_checkpoint(root, del_local_after_load=False)
    same("weights after loading the bf16 checkpoint vs when it was saved", {"w": weights(engine)}, {"w": stepped})
    same(
        "the step after the load vs the same step before it",
        {"steps": [window(engine, _local(engine, seed=1))], "w": weights(engine)},
        record,
    )
    return "; ".join([*detail, f"update {err:.1e} off the fp32 step", "save/load bit-exact"])
