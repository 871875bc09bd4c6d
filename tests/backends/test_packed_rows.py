"""Packed rows without varlen kernels (``backends.fsdp.forward.packed_rows``, issue 7).

With SDPA or eager attention a packed micro-batch is laid out in several rows when that is
cheaper than one long row (attention over a row costs (row tokens)^2 whatever the block
mask hides). The layout must not change any number the engine computes: log-probs and
values against the per-sequence HF reference (max |diff| <= 1e-5, fp32 summation order, as in
test_fsdp_parity.py) and one optimizer step against the independent raw step of
hf_utils.raw_step (relative 1e-6).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import backends.fsdp.forward as fwd
from tests.support.hf_utils import (
    LENGTHS,
    assert_same,
    engine_for,
    hf_log_probs,
    hf_values,
    make_model,
    make_test_batch,
    max_abs_diff,
    one_step,
    raw_step,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture
def narrow_rows(monkeypatch):
    """Force rows as narrow as the longest sequence (the tiny test batch would fit one row)."""
    monkeypatch.setattr(fwd, "row_layout", lambda lengths, config: (max(lengths), fwd._first_fit_decreasing(lengths, max(lengths))))


def _flat_case(lengths):
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    ids = torch.arange(int(offsets[-1])) + 100
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, pos, offsets


def test_layout_keeps_every_token_and_position_and_tails_restart(narrow_rows):
    lengths = [5, 9, 3, 12, 7, 4, 1]
    ids, pos, offsets = _flat_case(lengths)
    rows, row_pos, index = fwd.packed_rows(ids, pos, offsets, None)
    assert rows.shape[1] == 12 and index is not None
    assert torch.equal(rows.flatten()[index], ids) and torch.equal(row_pos.flatten()[index], pos)
    # First-fit-decreasing into width 12: 12 | 9+3 | 7+5 | 4+1 -> 4 rows.
    assert rows.shape[0] == 4
    free = torch.ones(rows.numel(), dtype=torch.bool)
    free[index] = False
    for r in range(rows.shape[0]):
        tail = row_pos[r][free.view_as(rows)[r]]
        # A row's unused tail counts 0, 1, ... so HF sees a separate sequence there.
        assert torch.equal(tail, torch.arange(len(tail)))
        assert bool((rows[r][free.view_as(rows)[r]] == 0).all())


def test_width_follows_the_cost_model():
    lengths = [16, 40, 1024, 300, 700, 90, 512, 64] * 2
    small = SimpleNamespace(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=32
    )
    # Attention dominates a 6k-token row for a small model: rows as narrow as the longest.
    assert fwd.row_layout(lengths, small)[0] == 1024
    # Short sequences cost little attention: one row.
    assert fwd.row_layout([5, 9, 3, 12], small)[0] == 29
    ids, pos, offsets = _flat_case([5, 9, 3, 12])
    rows, _, index = fwd.packed_rows(ids, pos, offsets, small)
    assert rows.shape == (1, 29) and index is None


@pytest.mark.parametrize("packed", [True, False], ids=["rows", "one-row"])
def test_log_probs_and_values_match_hf(model_dir, request, packed):
    if packed:
        request.getfixturevalue("narrow_rows")
    batch = make_test_batch(calculate_entropy=True)
    engine = engine_for(model_dir, "use_remove_padding=true")
    with engine.eval_mode():
        assert max_abs_diff(engine.infer_batch(batch)["log_probs"], hf_log_probs(model_dir, batch)) <= TOL
    critic = engine_for(model_dir, "use_remove_padding=true", "model.head=value", "seed=7")
    with critic.eval_mode():
        assert max_abs_diff(critic.infer_batch(batch)["values"], hf_values(model_dir, batch, 7)) <= TOL


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_one_step_in_rows_matches_the_raw_step(model_dir, narrow_rows, mode):
    assert max(LENGTHS) < sum(LENGTHS)  # the batch really spans several rows
    assert_same(one_step(model_dir, mode, ["micro_batch_size=6"]), raw_step(model_dir, mode), f"{mode}/rows")


def _gpt_oss_log_probs(rank, world, model_dir):
    from tests.support.hf_utils import engine_for, make_test_batch

    engine = engine_for(model_dir, "use_remove_padding=true")
    with engine.eval_mode():
        return {"remove_padding": engine.remove_padding, "log_probs": engine.infer_batch(engine.shard_data(make_test_batch()))["log_probs"]}


def test_a_family_whose_attention_ignores_packing_runs_padded(tmp_path):
    """GPT-OSS's attention (with its sinks) attends across a packed row's sequence boundaries
    (its packed logits are off by nats: the control below); the engine finds that at init and
    runs it padded, so its log-probs equal HF's per sequence."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from backends.fsdp.forward import packed_rows_exact
    from engine_api.conformance.fixtures import TINY_DIMS, save_model
    from tests.support.hf_utils import hf_log_probs, make_test_batch, max_abs_diff
    from tests.support.launch import run_distributed

    config = AutoConfig.for_model(
        "gpt_oss", **{**TINY_DIMS, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16, "head_dim": 8}
    )
    model_dir = save_model(config, tmp_path / "gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert not packed_rows_exact(model, config.vocab_size, torch.device("cpu"))
    llama = AutoModelForCausalLM.from_pretrained(save_model(AutoConfig.for_model("llama", **TINY_DIMS), tmp_path / "llama"))
    assert packed_rows_exact(llama, TINY_DIMS["vocab_size"], torch.device("cpu"))
    got = run_distributed(_gpt_oss_log_probs, 1, model_dir, timeout=300)[0]
    assert got["remove_padding"] is False
    assert max_abs_diff(got["log_probs"], hf_log_probs(model_dir, make_test_batch())) <= 1e-5
