"""Aligned log-probs and entropy on packed sequences vs a per-sequence direct computation."""

from __future__ import annotations

import torch

from engine_api.batch import make_batch, pack
from engine_api.logprobs import token_entropy, token_log_probs


def test_packed_log_probs_and_entropy_match_per_sequence_computation():
    g = torch.Generator().manual_seed(0)
    lengths = (4, 1, 6, 3)
    b = make_batch([torch.randint(0, 11, (n,), generator=g) for n in lengths])
    p = pack(b["input_ids"])
    logits = torch.randn(p.input_ids.shape[0], 11, generator=g)
    got_lp = token_log_probs(logits, p.input_ids, p.cu_seqlens)
    got_ent = token_entropy(logits, p.cu_seqlens)
    start = 0
    for n in lengths:
        ids, lg = p.input_ids[start : start + n], logits[start : start + n]
        probs = torch.softmax(lg.double(), -1)
        for t in range(n):
            want_lp = 0.0 if t == 0 else float(torch.log(probs[t - 1, ids[t]]))
            want_ent = 0.0 if t == 0 else float(-(probs[t - 1] * probs[t - 1].log()).sum())
            assert abs(float(got_lp[start + t]) - want_lp) < 1e-5
            assert abs(float(got_ent[start + t]) - want_ent) < 1e-5
        start += n


def test_low_precision_logits_give_float32_log_probs_and_entropy():
    """Models run in bf16 / fp16 (``engine.fsdp.param_dtype``, a bf16 rollout): the log-probs and
    entropy the losses and the rollout parity use are computed in fp32 from those logits, equal
    to the fp32 computation on the same values; a log_softmax in the logits' own precision is off
    by far more than float noise here (checked, so the comparison can tell the two apart)."""
    from engine_api.logprobs import next_token_entropy, next_token_log_probs

    g = torch.Generator().manual_seed(0)
    lengths = (5, 7)
    b = make_batch([torch.randint(0, 4000, (n,), generator=g) for n in lengths])
    p = pack(b["input_ids"])
    wide = torch.randn(p.input_ids.shape[0], 4000, generator=g) * 4  # a real vocabulary's spread
    for dtype in (torch.bfloat16, torch.float16):
        logits = wide.to(dtype)
        ref = logits.float()
        got_lp, want_lp = token_log_probs(logits, p.input_ids, p.cu_seqlens), token_log_probs(ref, p.input_ids, p.cu_seqlens)
        got_ent, want_ent = token_entropy(logits, p.cu_seqlens), token_entropy(ref, p.cu_seqlens)
        assert got_lp.dtype == got_ent.dtype == torch.float32, dtype
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_ent, want_ent, rtol=0, atol=1e-5)
        ids = p.input_ids[1:]
        torch.testing.assert_close(next_token_log_probs(logits[:-1], ids), next_token_log_probs(ref[:-1], ids), rtol=0, atol=1e-6)
        torch.testing.assert_close(next_token_entropy(logits), next_token_entropy(ref), rtol=0, atol=1e-5)
        low = torch.log_softmax(logits[:-1], -1).gather(-1, ids[:, None]).squeeze(-1).float()
        assert (low - next_token_log_probs(ref[:-1], ids)).abs().max() > 1e-3, dtype


def _head_case(seed: int = 0, total: int = 11, hidden: int = 8, vocab: int = 13):
    g = torch.Generator().manual_seed(seed)
    b = make_batch([torch.randint(0, vocab, (n,), generator=g) for n in (4, 1, 6)])
    b["target_ids"] = torch.nested.nested_tensor([torch.randint(0, vocab, (n, 2), generator=g) for n in (4, 1, 6)], layout=torch.jagged)
    h = torch.randn(total, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True)
    return b, h, w, bias


def test_chunked_head_equals_full_logits_values_and_gradients():
    """``HeadRequest`` (chunks of 3 tokens, temperature, entropy, [T, K] targets, top-3) against
    ``lm_token_outputs`` on the full fp32 logits of the same hidden states and head: values and
    the gradients of hidden states, weight and bias within fp32 summation noise (1e-5); the top-k
    of both against a plain sort of the log-softmax (the same ids, values to 1e-5)."""
    from engine_api.logprobs import HeadRequest, lm_token_outputs

    b, h, w, bias = _head_case()
    b.set_non_tensor("temperature", 0.7)
    b.set_non_tensor("calculate_entropy", True)
    b.set_non_tensor("return_topk", 3)
    p = pack(b["input_ids"])
    g = torch.Generator().manual_seed(5)
    coef = {
        "log_probs": torch.randn(11, generator=g),
        "entropy": torch.randn(11, generator=g),
        "target_log_probs": torch.randn(11, 2, generator=g),
    }

    def loss(outputs):  # a nonlinear loss of every output, so each gradient path counts
        return sum((outputs[k] * c + outputs[k].pow(2)).sum() for k, c in coef.items())

    want = lm_token_outputs(torch.nn.functional.linear(h, w, bias) / 0.7, p.input_ids, p.cu_seqlens, b)
    want_grads = torch.autograd.grad(loss(want), (h, w, bias))
    request = HeadRequest.of(b, p.input_ids, p.cu_seqlens)
    request.chunk_tokens = 3
    got = request.outputs(request.columns(h, w, bias))
    got_grads = torch.autograd.grad(loss(got), (h, w, bias))
    assert set(got) == set(want) == {"log_probs", "entropy", "target_log_probs", "topk_ids", "topk_log_probs"}
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    for a, c in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    hand = torch.log_softmax(torch.nn.functional.linear(h, w, bias).detach() / 0.7, -1).sort(-1, descending=True)
    for out in (got, want):
        assert out["topk_ids"].dtype == torch.int64 and torch.equal(out["topk_ids"], hand.indices[:, :3])
        torch.testing.assert_close(out["topk_log_probs"], hand.values[:, :3], rtol=1e-5, atol=1e-5)


def test_chunked_head_gathers_rows_by_index():
    """Hidden rows in another layout (padding, several rows): ``index`` picks each packed token."""
    from engine_api.logprobs import HeadRequest, lm_token_outputs

    b, h, w, bias = _head_case(1)
    p = pack(b["input_ids"])
    index = torch.randperm(20, generator=torch.Generator().manual_seed(2))[: p.input_ids.numel()]
    rows = torch.zeros(20, h.shape[1])
    rows[index] = h.detach()
    request = HeadRequest.of(b, p.input_ids, p.cu_seqlens, index)
    request.chunk_tokens = 4
    got = request.outputs(request.columns(rows.view(4, 5, -1), w, bias))
    want = lm_token_outputs(torch.nn.functional.linear(h, w, bias), p.input_ids, p.cu_seqlens, b)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
