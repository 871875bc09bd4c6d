"""Packed attention without flash-attn (``backends.fsdp.attention``, issue 52).

CPU: the doc-masked kernel (``sdpa_doc_mask``), and ``varlen``'s adapter over a CPU stand-in for
torch's CUDA-only kernel, on one packed row equal each sequence run alone through HF's own sdpa (log-probs and every parameter's gradient, fp32, 1e-5: summation
order only) on Llama (GQA, untied) and Qwen2 (GQA, qkv bias, tied); its boundaries come from
the batch's ``cu_seqlens``, so a perturbed earlier sequence leaves a later one bit-identical
even when the positions do not restart; one-token sequences keep their own boundaries (in the
kernels and through the FSDP engine's packed rows, against its padded micro-batches and HF); the
automatic choice (CUDA mocked) and its refusals.
GPU (``gpu`` mark): torch's ``varlen_attn`` kernel against per-sequence SDPA in bf16.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, MistralConfig

import backends.fsdp.attention as attn
from engine_api import build_engine, load_config
from engine_api.batch import pack
from tests.support.hf_utils import engine_for, hf_log_probs, make_model, make_one_token_batch, make_test_batch, max_abs_diff

TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family_dir(request, tmp_path_factory):
    return make_model(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def _log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False, **_):
    """A CPU stand-in for torch's varlen_attn (whose kernel is CUDA-only): each sequence of
    ``cu_q`` through causal SDPA, after checking the call is what the CUDA kernel needs."""
    assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
    assert max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    bounds = cu_q.tolist()
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=enable_gqa
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
    )


@pytest.fixture(params=[attn.DOC_MASK, attn.VARLEN])
def kernel(request, monkeypatch):
    """The kernel under test; ``varlen``'s HF adapter (layout, GQA, causal window, the batch's
    boundaries) runs over :func:`_reference_varlen` on CPU."""
    if request.param == attn.VARLEN:
        import torch.nn.attention.varlen as varlen

        monkeypatch.setattr(varlen, "varlen_attn", _reference_varlen)
    attn.register_packed_kernels()
    yield request.param
    monkeypatch.undo()
    attn.register_packed_kernels()  # the real kernel again


@pytest.mark.parametrize("make", [make_test_batch, make_one_token_batch], ids=["lengths", "one-token"])
def test_packed_kernel_equals_per_sequence_attention(family_dir, kernel, make):
    seqs = list(make()["input_ids"].unbind())
    weights = [torch.linspace(-1, 1, len(s) - 1) for s in seqs]  # a loss that weighs every log-prob
    alone = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32, attn_implementation="sdpa")
    want = [_log_probs(alone(s[None]).logits[0], s) for s in seqs]
    sum((lp * w).sum() for lp, w in zip(want, weights, strict=True)).backward()
    model = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32, attn_implementation=kernel)
    packed = pack(make()["input_ids"])
    pos = packed.position_ids[None]
    logits = model(input_ids=packed.input_ids[None], position_ids=pos, use_cache=False, **attn.packing_kwargs(pos)).logits[0]
    cu = packed.cu_seqlens.tolist()
    got = [_log_probs(logits[a:b], packed.input_ids[a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]
    sum((lp * w).sum() for lp, w in zip(got, weights, strict=True)).backward()
    assert max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True) if a.numel()) <= TOL
    got_g, want_g = _grads(model), _grads(alone)
    assert set(got_g) == set(want_g)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=TOL, atol=TOL, msg=name)


def test_one_token_sequences_keep_their_boundaries_in_the_engine(family_dir):
    """Packed log-probs (the tiny batch in one row) of a batch with one-token sequences (first,
    side by side, last) equal the padded micro-batches' and HF's per sequence (1e-5, fp32
    summation order): a one-token sequence merged with the next one (a boundary dropped in
    ``cu_seqlens_of`` / the document mask) moves the next sequence's log-probs by about 0.1
    (measured)."""
    batch = make_one_token_batch()
    got = {}
    for packed in (True, False):
        engine = engine_for(family_dir, f"use_remove_padding={packed}")
        assert engine.remove_padding is packed and engine.model.config._attn_implementation == attn.DOC_MASK
        with engine.eval_mode():
            got[packed] = engine.infer_batch(batch)["log_probs"]
    assert max_abs_diff(got[True], list(got[False].unbind())) <= TOL
    assert max_abs_diff(got[True], hf_log_probs(family_dir, batch)) <= TOL


def test_sequences_never_attend_across_boundaries():
    """The boundaries are the batch's ``cu_seqlens``, not guessed: two sequences whose
    positions run on (0..9, no restart) still do not see each other. Perturbing the first
    leaves the second's attention output bit-identical, and the premise holds: a plain causal
    mask over the same row does change it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 10, 8, generator=g) for _ in range(3))
    module = torch.nn.Module()
    kwargs = {attn.CU_KWARG: torch.tensor([0, 4, 10], dtype=torch.int32), attn.MAX_KWARG: 6, "position_ids": torch.arange(10)[None]}

    def second(k, v, **kw):
        return attn._doc_mask_attention(module, q, k, v, None, **kw)[0][0, 4:]

    k2, v2 = k.clone(), v.clone()
    k2[:, :, :4] += 1.0
    v2[:, :, :4] -= 1.0
    assert torch.equal(second(k, v, **kwargs), second(k2, v2, **kwargs))
    causal = F.scaled_dot_product_attention(q, k2, v2, is_causal=True).transpose(1, 2)[0, 4:]
    assert (causal - second(k, v, **kwargs)).abs().max() > 1e-2
    # without cu_seqlens the positions decide: here one sequence, so the perturbation shows
    assert not torch.equal(second(k, v, position_ids=kwargs["position_ids"]), second(k2, v2, position_ids=kwargs["position_ids"]))


def test_kernel_refuses_what_it_does_not_compute():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match=r"sdpa_doc_mask.*sliding_window = 2.*fix:"):
        attn._doc_mask_attention(torch.nn.Module(), q, q, q, None, sliding_window=2)
    with pytest.raises(RuntimeError, match=r"softcap = 50.0"):
        attn._doc_mask_attention(torch.nn.Module(), q, q, q, None, softcap=50.0)


def _llama_config():
    return AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)


@pytest.mark.parametrize(
    "device, dtype, flash, want",
    [
        ("cuda", torch.bfloat16, False, attn.VARLEN),
        ("cuda", torch.bfloat16, True, "flash_attention_2"),
        ("cuda", torch.float32, False, attn.DOC_MASK),  # torch's flash kernel runs half precision only
        ("cpu", torch.bfloat16, False, attn.DOC_MASK),
    ],
)
def test_auto_picks_by_device_and_installed_kernels(monkeypatch, device, dtype, flash, want):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" and flash else real(name, *a))
    monkeypatch.setattr(attn, "varlen_missing", lambda: None)  # a CUDA torch has it (this CPU torch 2.13 does too)
    assert attn.select_attention(_llama_config(), "auto", device, dtype) == want
    # an explicit choice is what runs
    assert attn.select_attention(_llama_config(), "sdpa", device, dtype) == "sdpa"


def test_auto_keeps_exact_kernels_for_other_attention(monkeypatch):
    monkeypatch.setattr(attn, "varlen_missing", lambda: None)
    bf16 = torch.bfloat16
    sliding = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, sliding_window=8)
    assert attn.select_attention(sliding, "auto", "cuda", bf16) is None  # HF's default (sdpa, its own sliding mask)
    capped = Gemma2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=8)
    assert attn.select_attention(capped, "auto", "cuda", bf16) == "eager"
    assert attn.select_attention(_llama_config(), "auto", "cuda", bf16, sp=2) is None  # Ulysses wraps HF's kernels


def test_choice_is_logged_once_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(attn, "varlen_missing", lambda: None)
    attn._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="enginekit.attention"):
        for _ in range(3):
            attn.select_attention(_llama_config(), "auto", "cuda", torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if r.name == "enginekit.attention"]
    assert len(lines) == 1 and lines[0].startswith("attention kernel: varlen (CUDA") and "varlen_attn" in lines[0]


def test_refusals_name_field_value_and_fix(monkeypatch):
    cfg, bf16 = _llama_config(), torch.bfloat16
    (cpu,) = attn.attention_problems(cfg, "varlen", "cpu", bf16)
    assert "model.attn_implementation = 'varlen'" in cpu and "CUDA device" in cpu and "fix: use auto" in cpu
    assert "bfloat16 / float16 only" in attn.attention_problems(cfg, "varlen", "cuda", torch.float32)[0]
    monkeypatch.setattr(attn, "varlen_missing", lambda: "torch 2.8 has no torch.nn.attention.varlen.varlen_attn (torch >= 2.10)")
    assert "torch 2.8 has no" in attn.attention_problems(cfg, "varlen", "cuda", bf16)[0]
    sliding = MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, sliding_window=8)
    assert "sliding_window = 8" in attn.attention_problems(sliding, "sdpa_doc_mask", "cpu", bf16)[0]
    assert "Ulysses" in attn.attention_problems(cfg, "sdpa_doc_mask", "cpu", bf16, sp=2)[0]


def test_varlen_on_cpu_refused_at_build_engine(tmp_path):
    path = make_model(tmp_path / "llama", "llama", num_layers=1)
    with pytest.raises(ValueError, match=r"model\.attn_implementation = 'varlen'.*CUDA device.*fix:"):
        build_engine(load_config(None, [f"model.path={path}", "model.attn_implementation=varlen", "model.dtype=bfloat16"]))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_varlen_kernel_equals_per_sequence_sdpa_in_bf16():
    """torch's varlen_attn through the HF attention function (GQA 8 query / 2 KV heads)
    against each sequence alone through SDPA (causal), bf16 inputs, outputs and the gradients
    of q, k, v. Tolerance 2e-2 absolute on unit-scale values: both kernels accumulate in fp32 and
    round to bf16 (eps 2^-8 ~ 4e-3), so a few bf16 ulps; attention across a boundary would be
    off by O(1)."""
    if attn.varlen_missing():
        pytest.skip(attn.varlen_missing())
    attn.register_packed_kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 5, 128, 1, 64]
    total = sum(lengths)
    q = torch.randn(1, 8, total, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, 2, total, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    module = torch.nn.Module()
    out = attn._varlen_attention(attn._varlen_params())(module, q, k, v, None, scaling=64**-0.5, **attn.packing_kwargs(pos))[0][0]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    want = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, enable_gqa=True)[0].transpose(0, 1)
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]
    )
    assert float((out.float() - want.float()).abs().max()) <= 2e-2
    gout = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    got_grads = torch.autograd.grad(out, (q, k, v), gout)
    want_grads = torch.autograd.grad(want, (q, k, v), gout)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert float((a.float() - b.float()).abs().max()) <= 2e-2


@pytest.mark.gpu
def test_engine_picks_varlen_on_cuda_and_matches_hf(tmp_path):
    """The FSDP engine on a GPU in bf16 without flash-attn runs ``varlen`` and its packed
    log-probs match HF per sequence (sdpa, bf16) within 2e-2 (``packed_rows_exact``'s bf16 bound)."""
    if attn.varlen_missing() or attn.resolve_attn_implementation(_llama_config(), "auto", "cuda") == "flash_attention_2":
        pytest.skip("torch without varlen_attn, or flash-attn installed (auto picks it)")
    from tests.support.hf_utils import engine_for

    path = make_model(tmp_path / "llama", "llama")
    engine = engine_for(path, "model.dtype=bfloat16")
    assert engine.model.config._attn_implementation == attn.VARLEN
    batch = make_test_batch()
    with engine.eval_mode():
        got = engine.infer_batch(batch)["log_probs"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    with torch.no_grad():
        for lp, ids in zip(got.unbind(), batch["input_ids"].unbind(), strict=True):
            ids = ids.cuda()
            want = _log_probs(hf(ids[None]).logits[0].float(), ids)
            assert float((lp[1:].cuda().float() - want).abs().max()) <= 2e-2
