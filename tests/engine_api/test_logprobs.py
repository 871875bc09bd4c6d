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
