"""Malformed batches for the bad-input tests, each with the words its error must contain.

Every builder derives its batch from the valid test batch (``hf_utils.make_test_batch``: 6
sequences of 3-12 tokens, vocabulary 64) and breaks exactly one thing. The needles name the
field and the offending value; every message must also carry a ``fix:``.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tests.support.hf_utils import VOCAB, make_test_batch

# The model max positions of hf_utils.make_model (posttrain.tiny_model's default) and the
# dynamic-batching budget the "over budget" case runs under.
MAX_POSITIONS = 64
TOKEN_BUDGET = 16


def _jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _with_ids(rows: list[torch.Tensor]) -> TensorDict:
    """A batch of these token rows, with a loss mask on every position but the first."""
    masks = [torch.cat([torch.zeros(1), torch.ones(r.shape[0] - 1)]) for r in rows]
    ids = _jagged(rows)
    mask = torch.nested.nested_tensor_from_jagged(torch.cat(masks), ids.offsets())
    adv = torch.nested.nested_tensor_from_jagged(torch.ones(int(ids.offsets()[-1])), ids.offsets())
    return TensorDict({"input_ids": ids, "loss_mask": mask, "advantages": adv}, batch_size=[len(rows)])


def with_token(batch: TensorDict, row: int, position: int, token: int) -> TensorDict:
    """``batch`` (any protocol batch) with one token id replaced."""
    rows = [r.clone() for r in batch["input_ids"].unbind()]
    rows[row][position] = token
    return _with_ids(rows)


def _rows() -> list[torch.Tensor]:
    return list(make_test_batch()["input_ids"].unbind())


def missing_input_ids():
    return make_test_batch().exclude("input_ids"), ["no 'input_ids'"]


def float_input_ids():
    good = make_test_batch()
    bad = good.clone()
    bad.set("input_ids", torch.nested.nested_tensor_from_jagged(good["input_ids"].values().float(), good["input_ids"].offsets()))
    return bad, ["input_ids has dtype torch.float32"]


def mismatched_jagged_field():
    good = make_test_batch()
    rows = list(good["advantages"].unbind())
    rows[1] = torch.cat([rows[1], torch.zeros(1)])  # one token too many in sequence 1
    bad = TensorDict({"input_ids": good["input_ids"], "loss_mask": good["loss_mask"], "advantages": _jagged(rows)}, batch_size=[6])
    n = good["input_ids"][1].shape[0]
    return bad, [f"advantages[1] has {n + 1} tokens but input_ids[1] has {n}"]


def token_id_at_vocab():
    return with_token(make_test_batch(), row=2, position=1, token=VOCAB), [f"token id {VOCAB}", f"[0, {VOCAB})"]


def negative_token_id():
    return with_token(make_test_batch(), row=0, position=-1, token=-3), ["token id -3", f"[0, {VOCAB})"]


def empty_batch():
    return TensorDict({}, batch_size=[0]), ["batch_size [0]"]


def all_masked_loss():
    good = make_test_batch()
    zeros = torch.nested.nested_tensor_from_jagged(torch.zeros_like(good["loss_mask"].values()), good["input_ids"].offsets())
    return TensorDict({**dict(good.items()), "loss_mask": zeros}, batch_size=[6]), ["loss_mask selects no token", "sum(loss_mask) = 0"]


def nan_loss_mask():
    good = make_test_batch()
    values = good["loss_mask"].values().clone()
    values[7] = float("nan")
    mask = torch.nested.nested_tensor_from_jagged(values, good["input_ids"].offsets())
    return TensorDict({**dict(good.items()), "loss_mask": mask}, batch_size=[6]), ["loss_mask holds nan"]


def longer_than_max_positions():
    rows = _rows()
    rows[3] = torch.randint(0, VOCAB, (MAX_POSITIONS + 6,), generator=torch.Generator().manual_seed(0))
    return _with_ids(rows), [f"input_ids[3] has {MAX_POSITIONS + 6} tokens", f"max of {MAX_POSITIONS}", "max_position_embeddings"]


def longer_than_token_budget():
    rows = _rows()
    rows[4] = torch.randint(0, VOCAB, (TOKEN_BUDGET + 4,), generator=torch.Generator().manual_seed(0))
    return _with_ids(rows), [f"input_ids[4] has {TOKEN_BUDGET + 4} tokens", f"max of {TOKEN_BUDGET}", "max_token_len_per_micro_batch"]


def not_a_tensordict():
    return dict(make_test_batch().items()), ["batch is a dict"]


def with_temperature(value):
    def build():
        batch = make_test_batch()
        batch.set_non_tensor("temperature", value)
        return batch, [f"temperature = {value!r}", "finite number > 0"]

    return build


def non_bool_entropy_switch():
    batch = make_test_batch()
    batch.set_non_tensor("calculate_entropy", "yes")
    return batch, ["calculate_entropy = 'yes'", "True or False"]


def strided_nested_ids():
    ids = torch.nested.nested_tensor(_rows())  # torch's default layout: strided
    return TensorDict({"input_ids": ids}, batch_size=[len(_rows())]), ["input_ids", "layout torch.strided", "layout=torch.jagged"]


def complex_input_ids():
    good = make_test_batch()
    values = good["input_ids"].values().to(torch.complex64)
    bad = TensorDict({"input_ids": torch.nested.nested_tensor_from_jagged(values, good["input_ids"].offsets())}, batch_size=[6])
    return bad, ["input_ids has dtype torch.complex64"]


def field_on_other_offsets():
    good = make_test_batch()
    adv = torch.nested.nested_tensor_from_jagged(good["advantages"].values(), good["input_ids"].offsets().clone())
    bad = TensorDict({"input_ids": good["input_ids"], "loss_mask": good["loss_mask"], "advantages": adv}, batch_size=[6])
    return bad, ["advantages has input_ids' lengths but its own offsets", "nested_tensor_from_jagged(values, batch['input_ids'].offsets())"]


# name -> builder; the engine config each runs under is chosen by the test (the budget case
# needs dynamic batching).
CASES = {
    "missing input_ids": missing_input_ids,
    "float input_ids": float_input_ids,
    "jagged field of another length": mismatched_jagged_field,
    "token id == vocab": token_id_at_vocab,
    "negative token id": negative_token_id,
    "empty batch": empty_batch,
    "all-masked loss": all_masked_loss,
    "NaN in loss_mask": nan_loss_mask,
    "longer than max positions": longer_than_max_positions,
    "longer than the token budget": longer_than_token_budget,
    "not a TensorDict": not_a_tensordict,
    "temperature 0": with_temperature(0.0),
    "temperature -1": with_temperature(-1.0),
    "temperature NaN": with_temperature(float("nan")),
    "calculate_entropy not a bool": non_bool_entropy_switch,
    "strided nested input_ids": strided_nested_ids,
    "complex input_ids": complex_input_ids,
    "per-token field on other offsets": field_on_other_offsets,
}
