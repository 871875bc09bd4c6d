"""Megatron mixed precision (issue 52, item 1): ``model.dtype=bfloat16`` trains, the megatron way.

Before, the engine kept fp32 parameters under ``TransformerConfig.bf16`` and every bf16 step
failed in the local spec's attention (``expected scalar type BFloat16 but found Float``), on
GPU and CPU alike. Now: bf16 parameters in megatron's ``Float16Module``, fp32 mains in
megatron's optimizer seeded with the HF weights exactly (``backends.megatron.precision``).

What is checked here, on CPU (the conformance kit's ``mixed_precision`` check adds exact start
weights, bf16 compute, the step against the fp32 reference and bit-exact save/load at every kit
layout):

* one bf16 step on megatron equals one bf16 step on FSDP for a dense untied model (Llama), a
  tied one with qkv biases (Qwen2) and Qwen3-MoE, with LoRA, and the critic's values. The
  tolerance is the bf16 noise floor measured in the same test: how far FSDP's own bf16 step is
  from its fp32 step on the same model (log-probs after the step, mean |diff|); megatron bf16
  must be within 3x that of FSDP bf16 (measured 0.9x / 0.8x / 1.2x on the three models). The
  loss and the pre-clip grad norm, reductions over every token, within 2^-7 relative (two bf16
  ulps; measured <= 1.6e-3). The same bounds hold between megatron's bf16 and fp32 steps;
* parameter and main dtypes: every model parameter bf16, every trained one with an fp32 main,
  the parameters equal to their mains rounded to bf16 after the step, RoPE's ``inv_freq``
  fp32, the export fp32;
* gradients accumulate (and so reduce over DP: megatron DDP reduces the same buffer) in fp32
  (``grad_reduce_in_fp32``): eight identical micro-batches add up to one's gradient exactly,
  which bf16 accumulation misses by its rounding (issue 60);
* a checkpoint records what its optimizer state's layout depends on (``model.dtype``, the
  distributed optimizer): a resume with another one is refused by name before anything is
  loaded (it failed half-loaded, ``KeyError: 'pre_wd_mult'``), and a checkpoint from before the
  record still resumes exactly where it matches (issue 60).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.gpu_step import step
from tests.support.hf_utils import make_model
from tests.support.launch import run_distributed

LOSS_RTOL = 2.0**-7
NOISE_FACTOR = 3.0


def _lp_diff(a: dict, b: dict) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a["log_probs"], b["log_probs"], strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / len(diffs)


def _megatron_precision(engine) -> dict:
    """What a bf16 megatron engine holds: parameter / main dtypes, whether each parameter is its
    main rounded to bf16, RoPE's inv_freq dtype, the exported dtypes."""
    from backends.megatron.precision import unwrap

    params, mains, rounded = set(), set(), True
    inv_freq = set()
    for chunk in engine.model:
        model = unwrap(chunk)
        for p in model.parameters():
            params.add(str(p.dtype))
            if p.requires_grad:
                mains.add(str(p.main_param.dtype))
                rounded &= torch.equal(p.data, p.main_param.to(p.dtype))
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is not None:
            inv_freq.add(str(rotary.inv_freq.dtype))
    exported = {str(t.dtype) for _, t in engine.export_weights()}
    return {
        "params": sorted(params),
        "mains": sorted(mains),
        "rounded": rounded,
        "inv_freq": sorted(inv_freq),
        "exported": sorted(exported),
    }


def _compare(rank, world, model_dir: str, extra: list[str]) -> dict:
    """FSDP fp32, FSDP bf16 and megatron bf16 one step each, in this rank (FSDP first: megatron
    switches its CPU compat layer on for the rest of the task)."""
    seen = {}
    return {
        "fsdp32": step("fsdp", model_dir, *extra, dtype="float32"),
        "fsdp16": step("fsdp", model_dir, *extra),
        "megatron32": step("megatron", model_dir, *extra, dtype="float32"),
        "megatron16": step("megatron", model_dir, *extra, engine_hook=lambda e: seen.update(_megatron_precision(e))),
        "precision": seen,
    }


def _assert_parity(r: dict, against: str = "fsdp16") -> None:
    """megatron bf16 within the noise floor of ``against``: FSDP's bf16 step, or (LoRA, whose
    adapters the two backends initialise from different draws) megatron's own fp32 step."""
    noise = _lp_diff(r["fsdp16"], r["fsdp32"])
    got = _lp_diff(r["megatron16"], r[against])
    assert got <= NOISE_FACTOR * noise, f"log-probs after the step: megatron bf16 vs {against} {got:.2e}, bf16 noise floor {noise:.2e}"
    for key in ("loss", "grad_norm"):
        rel = abs(r["megatron16"][key] - r[against][key]) / abs(r[against][key])
        assert rel <= LOSS_RTOL, (key, r["megatron16"][key], r[against][key], rel)
    p = r["precision"]
    assert p["params"] == ["torch.bfloat16"] and p["mains"] == ["torch.float32"] and p["rounded"], p
    assert p["inv_freq"] in ([], ["torch.float32"]) and p["exported"] == ["torch.float32"], p


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.backends.moe_utils import build_moe_models

    root = tmp_path_factory.mktemp("bf16")
    return {
        "llama": make_model(root / "llama", "llama"),
        "qwen2": make_model(root / "qwen2", "qwen2"),  # tied head, qkv bias
        "qwen3_moe": build_moe_models(root)["qwen3_moe"],
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_bf16_step_megatron_equals_fsdp(models, family):
    (r,) = run_distributed(_compare, 1, models[family], [], timeout=300)
    _assert_parity(r)
    _assert_parity(r, against="megatron32")


def test_bf16_lora_step_megatron_equals_fsdp(models):
    """LoRA under bf16: the frozen base in bf16, the adapters with fp32 mains (the only
    trained parameters). megatron draws its initial adapters differently from peft (the kit's
    ``lora`` check trains both from the engine's own initial adapters), so the bf16 step is held
    to megatron's own fp32 step, within the bf16 noise floor FSDP + peft shows on the same model."""
    (r,) = run_distributed(_compare, 1, models["llama"], ["model.lora.rank=4", "model.lora.alpha=8"], timeout=300)
    _assert_parity(r, against="megatron32")


ACCUMULATED = 8  # micro-batches: a power of two, so each one's share of the gradient is exact


def _accumulated_grads(rank, world, model_dir: str) -> dict:
    """megatron DDP's gradient buffers (``main_grad``) after one sequence alone and after
    :data:`ACCUMULATED` copies of it, one per micro-batch (``seq-mean-token-sum``: each copy's
    loss is 1/8 of the lone one's), before any optimizer step."""
    from engine_api import make_batch
    from tests.support.hf_utils import engine_for, make_test_batch

    engine = engine_for(
        model_dir, "model.dtype=bfloat16", "megatron.layer_spec=local", "micro_batch_size=1", "loss_agg_mode=seq-mean-token-sum",
        "deferred_normalization=false", strategy="megatron",
    )  # fmt: skip
    base = make_test_batch()
    i = max(range(base.batch_size[0]), key=lambda j: len(base["input_ids"][j]))
    fields = {k: base[k][i] for k in ("input_ids", "loss_mask", "advantages")}

    def grads(copies: int) -> list[torch.Tensor]:
        batch = make_batch([fields["input_ids"]] * copies, **{k: [fields[k]] * copies for k in ("loss_mask", "advantages")})
        engine.optimizer_zero_grad()
        engine.forward_backward_step(batch)
        return [g.detach().clone() for g in engine._grad_buffers()]

    with engine.train_mode():
        one, many = grads(1), grads(ACCUMULATED)
    return {"one": [g.float() for g in one], "many": [g.float() for g in many], "dtypes": sorted({str(g.dtype) for g in many})}


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b, strict=True))
    return (num / sum(float(y.double().pow(2).sum()) for y in b)) ** 0.5


def test_bf16_gradients_accumulate_in_fp32(models):
    """Eight micro-batches of the same sequence, each 1/8 of the lone sequence's loss: every
    micro-batch's bf16 gradient is the lone one's divided by 8 exactly (a power of two commutes
    with rounding), and a partial sum of k of them needs at most 3 more significant bits than
    bf16's 8, so fp32 accumulation returns the lone gradient exactly. Tolerance: relative L2
    2^-16, far above fp32 rounding (2^-24 per add; measured: 0) and far below bf16's (2^-9 per
    add): the same sum accumulated in bf16, computed below from the lone gradient, misses it by
    3.8e-3, and so does the engine with ``grad_reduce_in_fp32=False`` (measured: the same 3.8e-3;
    megatron DDP then also reduces over DP in bf16, the same buffer)."""
    (r,) = run_distributed(_accumulated_grads, 1, models["llama"], timeout=300)
    got = _rel(r["many"], r["one"])
    assert got <= 2.0**-16, f"gradient of {ACCUMULATED} accumulated micro-batches vs one: relative {got:.2e}"
    assert r["dtypes"] == ["torch.float32"], r["dtypes"]
    # The premise: bf16 accumulation of the same shares is visibly off (the check can fail).
    in_bf16 = []
    for g in r["one"]:
        acc = torch.zeros_like(g, dtype=torch.bfloat16)
        for _ in range(ACCUMULATED):
            acc += (g / ACCUMULATED).to(torch.bfloat16)
        in_bf16.append(acc.float())
    assert _rel(in_bf16, r["one"]) > 2.0**-12


def _resume_across_layouts(rank, world, model_dir: str, root: str) -> dict:
    """One step and a checkpoint in bf16 and in fp32; engines of the other dtype (and the fp32
    checkpoint into a distributed-optimizer engine) try to load them: each one's error and
    whether its weights were left untouched. Then the bf16 checkpoint with its marker's record
    removed (a checkpoint from before issue 60) loaded at bf16: its step, and whether the loaded
    weights (fp32 mains) equal the saved engine's."""
    import json
    import os

    from engine_api import ckpt_layout
    from tests.support.hf_utils import engine_for, full_params, make_test_batch

    def engine(dtype: str, *extra: str):
        return engine_for(model_dir, f"model.dtype={dtype}", "megatron.layer_spec=local", *extra, strategy="megatron")

    def saved(dtype: str) -> tuple[str, dict]:
        trained = engine(dtype)
        with trained.train_mode():
            trained.train_batch(make_test_batch())
        trained.save_checkpoint(os.path.join(root, dtype), global_step=1)
        return os.path.join(root, dtype), full_params(trained)

    def refusal(path: str, dtype: str, *extra: str) -> dict:
        fresh = engine(dtype, *extra)
        before = full_params(fresh)
        try:
            fresh.load_checkpoint(path, del_local_after_load=False)
            error = None
        except Exception as exc:  # noqa: BLE001 - which error, reported to the test
            error = f"{type(exc).__name__}: {exc}"
        after = full_params(fresh)
        return {"error": error, "untouched": all(torch.equal(before[k], after[k]) for k in before)}

    (bf16, bf16_weights), (fp32, _) = saved("bfloat16"), saved("float32")
    out = {
        "bf16->fp32": refusal(bf16, "float32"),
        "fp32->bf16": refusal(fp32, "bfloat16"),
        "plain->distributed": refusal(fp32, "float32", "megatron.use_distributed_optimizer=true"),
    }
    marker = os.path.join(bf16, "global_step_1", ckpt_layout.MARKER)
    with open(marker) as f:
        info = json.load(f)
    out["recorded"] = info.pop("optimizer", None)
    with open(marker, "w") as f:
        json.dump(info, f)
    old = engine("bfloat16")
    out["old_step"] = old.load_checkpoint(bf16, del_local_after_load=False)
    loaded = full_params(old)
    out["old_exact"] = set(loaded) == set(bf16_weights) and all(torch.equal(loaded[k], v) for k, v in bf16_weights.items())
    return out


def test_a_checkpoint_resumed_with_another_optimizer_layout_is_refused_before_loading(models, tmp_path):
    """Saved in bf16 (fp32 mains in the optimizer state) and loaded in fp32, or the reverse, or
    saved without the distributed optimizer and loaded with it: a ValueError naming the setting,
    this engine's value, the saved one and the fix, raised before anything is read (the engine's
    weights bit-identical). Before, the first failed half-way (``KeyError: 'pre_wd_mult'``, the
    model already overwritten) and the others with a bare ``CheckpointException``. A checkpoint
    whose marker has no record (saved before it existed) loads as before where it matches: the
    step, and the weights bit-exact."""
    (r,) = run_distributed(_resume_across_layouts, 1, models["llama"], str(tmp_path), timeout=400)
    for case, (was, now) in {"bf16->fp32": ("bfloat16", "float32"), "fp32->bf16": ("float32", "bfloat16")}.items():
        err = r[case]["error"] or ""
        assert err.startswith("ValueError: checkpoint "), (case, err)
        assert f"model.dtype = '{now}' in this engine" in err and f"saved with '{was}'" in err, (case, err)
        assert f"fix: resume with model.dtype={was} " in err and "nothing was loaded" in err, (case, err)
        assert r[case]["untouched"], case
    err = r["plain->distributed"]["error"] or ""
    assert err.startswith("ValueError: checkpoint ") and "megatron.use_distributed_optimizer = True in this engine, saved with False" in err
    assert "fix: resume with megatron.use_distributed_optimizer=false" in err and r["plain->distributed"]["untouched"], err
    assert r["recorded"] == {"model_dtype": "bfloat16", "use_distributed_optimizer": False}
    assert r["old_step"] == 1 and r["old_exact"]


def _values(rank, world, model_dir: str) -> dict:
    from tests.support.hf_utils import engine_for, make_test_batch

    out = {}
    for name, strategy, dtype in (("fsdp32", "fsdp", "float32"), ("fsdp16", "fsdp", "bfloat16"), ("megatron16", "megatron", "bfloat16")):
        engine = engine_for(model_dir, "model.head=value", f"model.dtype={dtype}", strategy=strategy)
        with engine.eval_mode():
            got = engine.infer_batch(engine.shard_data(make_test_batch()))
        out[name] = {"log_probs": [row.float().tolist() for row in got["values"].unbind()]}
    return out


def test_bf16_critic_values_megatron_equal_fsdp(models):
    """The critic's value head under bf16 (replicated head, fp32 output): values within the
    same noise-floor bound as the log-probs."""
    (r,) = run_distributed(_values, 1, models["qwen2"], timeout=300)
    noise, got = _lp_diff(r["fsdp16"], r["fsdp32"]), _lp_diff(r["megatron16"], r["fsdp16"])
    assert got <= NOISE_FACTOR * noise, (got, noise)


def test_megatron_refuses_compile(models):
    """``compile=true`` (issue 52, item 3: FSDP's per-layer torch.compile) is refused by megatron
    at build_engine, naming the key and the fix, not ignored."""
    from engine_api import build_engine, load_config

    with pytest.raises(ValueError, match=r"compile = True: the megatron engine does not torch.compile.*fix: set compile=false"):
        build_engine(load_config(None, ["strategy=megatron", f"model.path={models['llama']}", "compile=true"]))
