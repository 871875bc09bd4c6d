"""Config variants of the supported families on the megatron backend (issue 28, item 1): every HF
config field that changes the computation is converted exactly or refused at ``build_engine``,
and every HF tensor / megatron parameter is accounted for by the conversion table.

Exact variants (each a tiny model built from its HF config with a fixed seed; biases and norms
are randomised, since HF initialises them to 0 / 1, which would hide a dropped or swapped bias):
Llama ``attention_bias`` (q/k/v AND o_proj bias), Llama ``mlp_bias``, Qwen3 ``attention_bias``
(q/k/v/o bias, bias-free MLP), Qwen3-MoE ``attention_bias``, ``hidden_act`` gelu (exact),
gelu_pytorch_tanh / gelu_new (tanh), swish, and all of Llama's at once; Llama with
``attention_dropout > 0``. Checks: megatron log-probs equal a per-sequence HF forward (fp32,
1e-5, the project's HF parity tolerance); export gives back the checkpoint's HF tensors
bit-exactly (names and values); the combined Llama variant also at TP=2.

Refused at ``build_engine`` with the field named: ``hidden_act`` relu, Phi-3 ``resid_pdrop > 0``,
a declared config field the converter has not audited. Refused at load: an HF tensor no rule
consumes (named, with the config field likely responsible), and a rule whose tensor is missing.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Phi3Config, Qwen3Config, Qwen3MoeConfig

from engine_api import build_engine, load_config
from engine_api.conformance.fixtures import TINY_DIMS, save_model
from tests.support import megatron_workers as W
from tests.support.hf_utils import (
    assert_same,
    engine_for,
    full_params,
    hf_log_probs,
    hf_log_probs_of,
    make_test_batch,
    max_abs_diff,
    one_step,
)
from tests.support.launch import run_distributed

TOL = 1e-5  # the project's HF parity tolerance in fp32
# Larger weights than HF's 0.02 so that every projection moves the log-probs well beyond TOL.
BASE = {**TINY_DIMS, "initializer_range": 0.3}
QWEN3 = {**BASE, "head_dim": 16}  # decoupled head_dim (4 heads x 16 != hidden 32)
VARIANTS = {
    "llama_attention_bias": LlamaConfig(**BASE, attention_bias=True),
    "llama_mlp_bias": LlamaConfig(**BASE, mlp_bias=True),
    "qwen3_attention_bias": Qwen3Config(**QWEN3, attention_bias=True),
    "qwen3_moe_attention_bias": Qwen3MoeConfig(
        **QWEN3, attention_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True
    ),
    "llama_gelu": LlamaConfig(**BASE, hidden_act="gelu"),
    "llama_gelu_pytorch_tanh": LlamaConfig(**BASE, hidden_act="gelu_pytorch_tanh"),
    "llama_gelu_new": LlamaConfig(**BASE, hidden_act="gelu_new"),
    "llama_swish": LlamaConfig(**BASE, hidden_act="swish"),
    "llama_combined": LlamaConfig(**BASE, attention_bias=True, mlp_bias=True, hidden_act="gelu_pytorch_tanh"),
}
DROPOUT = 0.3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    out = {name: save_model(cfg, root / name) for name, cfg in VARIANTS.items()}
    out["plain"] = save_model(LlamaConfig(**BASE), root / "plain")  # same seed, no biases, SiLU
    out["dropout"] = save_model(LlamaConfig(**BASE, attention_dropout=DROPOUT), root / "dropout")
    # A checkpoint with an o_proj bias that config.json (attention_bias: false) does not mention.
    out["extra"] = _with_state(out["plain"], root / "extra", lambda s: {**s, "model.layers.0.self_attn.o_proj.bias": torch.ones(32)})
    # config.json says attention_bias but the checkpoint has no o_proj biases.
    out["missing"] = _with_state(
        out["llama_attention_bias"], root / "missing", lambda s: {k: v for k, v in s.items() if not k.endswith("o_proj.bias")}
    )
    return out


def _with_state(src: str, dst, edit) -> str:
    """A copy of model directory ``src`` whose safetensors state is ``edit(state)``."""
    os.makedirs(dst, exist_ok=True)
    AutoModelForCausalLM.from_pretrained(src).config.save_pretrained(dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in edit(state).items()}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _load_error(path) -> str | None:
    try:
        engine_for(path, strategy="megatron")
    except ValueError as exc:
        return str(exc)
    return None


def _dropout(path) -> dict:
    """Eval log-probs, the built config's dropouts, and two train-mode forwards' log-probs."""
    engine = engine_for(path, strategy="megatron")
    with engine.eval_mode():
        eval_lp = engine.infer_batch(make_test_batch())["log_probs"]
    seen = []

    def capture(mb, out, norm):
        seen.append(out["log_probs"].detach().clone())
        return out["log_probs"].sum() * 0.0, {}

    engine.set_loss_fn(capture)
    with engine.train_mode():
        for _ in range(2):
            engine.forward_backward_step(make_test_batch())
    return {"eval": eval_lp, "train": seen, "attention": engine.tconfig.attention_dropout, "hidden": engine.tconfig.hidden_dropout}


def _resume(path, ckpt_dir) -> dict:
    """Weights after one step, and the weights a fresh engine has after loading that step's
    checkpoint (the biases and gelu MLP go through megatron's dist_checkpointing too)."""
    engine = engine_for(path, strategy="megatron")
    with engine.train_mode():
        engine.train_batch(make_test_batch())
    engine.save_checkpoint(ckpt_dir, global_step=1)
    trained = full_params(engine)
    fresh = engine_for(path, strategy="megatron")
    fresh.load_checkpoint(ckpt_dir, del_local_after_load=False)
    return {"trained": trained, "resumed": full_params(fresh), "initial": full_params(engine_for(path, strategy="megatron"))}


def _single(rank, world, models, ckpt_dir):
    out = {}
    out["step"] = W.one_step(models["llama_combined"], "token-mean", [])
    out["resume"] = _resume(models["llama_combined"], ckpt_dir)
    for name in VARIANTS:
        out[("log_probs", name)] = W.infer(models[name], "micro_batch_size=2")["log_probs"]
        out[("export", name)] = full_params(engine_for(models[name], strategy="megatron"))
    out["dropout"] = _dropout(models["dropout"])
    out["extra"] = _load_error(models["extra"])
    out["missing"] = _load_error(models["missing"])
    return out


def _tp2(rank, world, path):
    out = {"log_probs": W.infer(path, "micro_batch_size=2", "megatron.tensor_model_parallel_size=2")["log_probs"]}
    out["export"] = full_params(engine_for(path, "megatron.tensor_model_parallel_size=2", strategy="megatron"))
    return out


@pytest.fixture(scope="module")
def single(models, tmp_path_factory):
    return run_distributed(_single, 1, models, str(tmp_path_factory.mktemp("variants_ckpt")), timeout=600)[0]


def _hf_state(path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _hf_without_the_variant(path, batch) -> list[torch.Tensor]:
    """HF's log-probs of the same weights with every bias zeroed and SiLU (the variant undone)."""
    cfg = AutoConfig.from_pretrained(path)
    cfg.hidden_act = "silu"
    model = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    return hf_log_probs_of(model, batch)


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "llama_swish"])  # swish is SiLU
def test_the_variant_changes_hf_log_probs(models, name):
    """Control: undoing the variant on the same weights moves HF's log-probs far beyond the
    tolerance, so a converter that ignored the field could not pass the parity tests below."""
    batch = make_test_batch()
    with_variant = torch.nested.as_nested_tensor(hf_log_probs(models[name], batch), layout=torch.jagged)
    assert max_abs_diff(with_variant, _hf_without_the_variant(models[name], batch)) > 100 * TOL


@pytest.mark.parametrize("name", VARIANTS)
def test_log_probs_match_hf(single, models, name):
    assert max_abs_diff(single[("log_probs", name)], hf_log_probs(models[name], make_test_batch())) <= TOL


@pytest.mark.parametrize("name", VARIANTS)
def test_export_gives_back_the_hf_tensors_exactly(single, models, name):
    got, want = single[("export", name)], _hf_state(models[name])
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_biases_are_randomised(models):
    """The bias tensors the variants test are not HF's zeros (which would hide a dropped bias)."""
    state = _hf_state(models["llama_combined"])
    biases = [k for k in state if k.endswith(".bias")]
    assert {k.rsplit(".", 2)[-2] for k in biases} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(float(state[k].abs().min()) > 0 for k in biases)


def test_combined_variant_at_tp2_matches_hf_and_round_trips(models):
    got = run_distributed(_tp2, 2, models["llama_combined"], timeout=600)[0]
    assert max_abs_diff(got["log_probs"], hf_log_probs(models["llama_combined"], make_test_batch())) <= TOL
    want = _hf_state(models["llama_combined"])
    assert set(got["export"]) == set(want) and all(torch.equal(got["export"][k], want[k]) for k in want)


def test_combined_variant_step_equals_the_fsdp_step(single, models):
    """One AdamW step of the biased gelu model: loss, grad norm and updated weights (biases
    included) equal the FSDP engine's, which trains the HF model itself (relative 1e-5, as the
    other cross-backend tests)."""
    assert_same(single["step"], one_step(models["llama_combined"], "token-mean"), "llama_combined, megatron vs fsdp", rtol=1e-5)


def test_a_checkpoint_of_the_biased_model_resumes_bit_exactly(single):
    r = single["resume"]
    assert set(r["resumed"]) == set(r["trained"])
    assert all(torch.equal(r["resumed"][k], r["trained"][k]) for k in r["trained"])
    assert any(not torch.equal(r["initial"][k], r["trained"][k]) for k in r["trained"] if k.endswith("o_proj.bias"))


def test_attention_dropout_is_megatrons_attention_dropout(single, models):
    """attention_dropout -> megatron's attention dropout (hidden dropout 0): eval is HF's exact
    forward; in training the dropout draws differ from call to call."""
    d = single["dropout"]
    assert d["attention"] == DROPOUT and d["hidden"] == 0.0
    assert max_abs_diff(d["eval"], hf_log_probs(models["dropout"], make_test_batch())) <= TOL
    first, second = d["train"]
    assert max_abs_diff(first, list(d["eval"].unbind())) > 100 * TOL
    assert max_abs_diff(first, list(second.unbind())) > 100 * TOL


def test_an_unconsumed_hf_tensor_fails_the_load_naming_it(single):
    error = single["extra"]
    assert error is not None and "'model.layers.0.self_attn.o_proj.bias'" in error and "attention_bias" in error, error


def test_a_missing_hf_tensor_fails_the_load_naming_it(single):
    error = single["missing"]
    assert error is not None and "model.layers.0.self_attn.o_proj.bias" in error and "attention_bias" in error, error


def _build_error(tmp_path, cfg) -> str:
    path = save_model(cfg, tmp_path / "m")
    with pytest.raises(ValueError) as info:
        build_engine(load_config(None, ["strategy=megatron", f"model.path={path}"]))
    return str(info.value)


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (LlamaConfig(**BASE, hidden_act="relu"), "hidden_act = 'relu'"),
        (Phi3Config(**BASE, pad_token_id=None, bos_token_id=1, eos_token_id=2, resid_pdrop=0.1), "resid_pdrop = 0.1"),
    ],
    ids=["relu", "phi3-resid_pdrop"],
)
def test_unconvertible_values_are_refused_at_build_engine(tmp_path, cfg, field):
    error = _build_error(tmp_path, cfg)
    assert field in error and "fix:" in error and "strategy=fsdp" in error, error


def test_a_declared_field_nobody_audited_is_refused(tmp_path, monkeypatch):
    """A field the config class declares that is neither mapped nor known harmless (here: as if
    mlp_bias had never been looked at) is refused when it is not at its default."""
    from backends.megatron import convert

    monkeypatch.delitem(convert.MAPPED_FIELDS, "mlp_bias")
    assert convert.config_refusals(LlamaConfig(**BASE)) == []
    error = "; ".join(convert.config_refusals(LlamaConfig(**BASE, mlp_bias=True)))
    assert "mlp_bias = True" in error and "not audited" in error, error


def test_every_declared_field_of_the_families_is_audited():
    """Each field the supported families' config classes declare is mapped or known harmless
    (fails when a transformers upgrade adds one: it must be looked at)."""
    import dataclasses

    from transformers import MistralConfig, MixtralConfig, PretrainedConfig, Qwen2Config

    from backends.megatron.convert import HARMLESS_FIELDS, MAPPED_FIELDS

    base = {f.name for f in dataclasses.fields(PretrainedConfig)}
    for cls in (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig, MixtralConfig, Phi3Config):
        own = {f.name for f in dataclasses.fields(cls)} - base
        assert own <= set(MAPPED_FIELDS) | set(HARMLESS_FIELDS), (cls.__name__, own - set(MAPPED_FIELDS) - set(HARMLESS_FIELDS))
