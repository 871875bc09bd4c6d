"""The HF sampler stops at a stop string that spans several tokens (issue 28, item 9).

With a character-level tokenizer every multi-character stop string is split across tokens, so
only the decoded text of the response's tail can find it. The reference is the same sampler
with no stop strings: every sample draws from its own seeded generator, so a stopped sample is
the free-running one cut after the first token whose decoded prefix contains a stop string
(``finish_reason`` "stop"), and a sample that never contains one is unchanged ("length").
The cut is computed here by plain string search on the decoded free-running samples.
"""

from __future__ import annotations

import pytest
import torch

from engine_api.rollout import RolloutEngineConfig, SamplingParams
from engine_api.rollout_registry import build_rollout
from tests.support import user_data as ud

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    model = ud.build_model_dir(tmp_path_factory.mktemp("hf_stop") / "model")
    engine = build_rollout("hf", RolloutEngineConfig(model_path=model, tokenizer_path=model))
    yield engine
    engine.shutdown()


# Two prompts of one length (batched together: one row stops while the other goes on) and one
# of another length.
PROMPTS = [[1, 8, 9, 10], [1, 12, 7, 8], [1, 9, 9, 20, 11, 6, 7]]
SEEDS = [3, 4, 5]


def _generate(rollout, stop: tuple[str, ...], n: int = 2) -> list:
    params = SamplingParams(n=n, max_tokens=MAX_TOKENS, stop=stop)
    return [s for group in rollout.generate([torch.tensor(p) for p in PROMPTS], params, SEEDS) for s in group]


def _decode(rollout, ids: list[int]) -> str:
    return rollout.tokenizer.decode(ids, skip_special_tokens=False)


def _expected(rollout, free: list, stop: tuple[str, ...]) -> list[tuple[list[int], str]]:
    out = []
    for sample in free:
        ids = sample.token_ids.tolist()
        cut = next((m for m in range(1, len(ids) + 1) if any(s in _decode(rollout, ids[:m]) for s in stop)), None)
        out.append((ids[:cut], "stop") if cut is not None else (ids, "length"))
    return out


def _span(rollout, ids: list[int], start: int, size: int, plain: bool = True, doubled: bool = False) -> str | None:
    """The text of ``size`` consecutive tokens of a free-running sample, from position
    ``start`` on, not present earlier in the sample. ``plain``: each token one character;
    ``doubled``: the same character twice (a stop like "33")."""
    for k in range(start, len(ids) - size):
        pieces = [_decode(rollout, [t]) for t in ids[k : k + size]]
        text = "".join(pieces)
        if plain and not all(len(p) == 1 for p in pieces) or doubled and len(set(ids[k : k + size])) != 1:
            continue
        if text not in _decode(rollout, ids[: k + size - 1]):
            return text
    return None


def _stops(rollout, free, kind: str) -> tuple[str, ...]:
    if kind == "2-and-3-chars":  # two stops at once, each spanning tokens
        found = (_span(rollout, free[0].token_ids.tolist(), 3, 2), _span(rollout, free[3].token_ids.tolist(), 5, 3))
    elif kind == "10-tokens":  # longer than the 8 tokens of slack in the decoded window
        found = (_span(rollout, free[5].token_ids.tolist(), 4, 10, plain=False),)
    else:  # "doubled": a stopped row is fed its last token again; "33" must not be found again in "333"
        found = (next((t for s in free if (t := _span(rollout, s.token_ids.tolist(), 1, 2, doubled=True))), None),)
    if None in found:
        pytest.skip(f"no {kind} span in the free-running samples (change SEEDS)")
    return found


@pytest.mark.parametrize("kind", ["2-and-3-chars", "10-tokens", "doubled"])
def test_a_stop_string_split_across_tokens_stops_the_sample_there(rollout, kind):
    free = _generate(rollout, ())
    assert all(s.finish_reason == "length" and len(s.token_ids) == MAX_TOKENS for s in free)
    stop = _stops(rollout, free, kind)
    got = _generate(rollout, stop)
    want = _expected(rollout, free, stop)
    for i, (sample, (ids, reason)) in enumerate(zip(got, want, strict=True)):
        assert sample.token_ids.tolist() == ids and sample.finish_reason == reason, f"sample {i}: stop {stop}"
        assert len(sample.log_probs) == len(ids)
        torch.testing.assert_close(sample.log_probs, free[i].log_probs[: len(ids)])  # the same draws, cut
    assert any(reason == "stop" for _, reason in want) and any(reason == "length" for _, reason in want)
    assert all(len(ids) >= 2 for ids, reason in want if reason == "stop")  # the stops did span tokens


def test_a_stop_string_that_never_appears_changes_nothing(rollout):
    free = _generate(rollout, (), n=1)
    never = "?" * 5  # '?' is the unknown token's text; five in a row do not occur below
    assert all(never not in _decode(rollout, s.token_ids.tolist()) for s in free)
    got = _generate(rollout, (never,), n=1)
    assert [s.token_ids.tolist() for s in got] == [s.token_ids.tolist() for s in free]
    assert all(s.finish_reason == "length" for s in got)
