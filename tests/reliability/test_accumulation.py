"""Abort and streaming accumulation (issue 6, item 3), on every built-in backend.

Abort: ``optimizer_zero_grad()`` after one or more ``forward_backward_step`` calls (or after a
call that raised part-way, in the loss function) discards the window with no trace: params,
optimizer state, step counter and LR are bit-identical to before the window, and the next
full window is bit-identical to the same window on a twin engine that never saw the aborted
data. Bit-exact is the right bar: both engines then run the very same operations on the very
same state. Run with and without deferred normalization (a deferred window that is not
reset on abort leaks its token counts into the next step's denominator: the grad norm and
every parameter move), single process and at every 2-rank layout.

Streaming: in deferred mode, a global batch arriving over any number of
``forward_backward_step`` calls in any grouping (1/2/3, one call per sample, calls whose
size is not a multiple of the micro-batch size, dynamic batching per call; at 2 ranks, a
different grouping on each rank) gives the step of one non-deferred call: grad norm and updated parameters within
relative 1e-6 (fp32; the gradient is summed in a different order, so bit-exactness is not
expected), for every loss aggregation mode.
"""

from __future__ import annotations

import math

import pytest

from engine_api import AGG_MODES
from tests.reliability._step_common import (
    local_batch,
    new_engine,
    rel_diff,
    reset_layout,
    run,
    run_window,
    snapshot,
    snapshot_diff,
    two_rank_layouts,
    worker_setup,
)
from tests.support.hf_utils import pg_loss

RTOL = 1e-6
CONSTANT = 8.0  # C of seq-mean-token-sum-norm
MODES_2RANK = ("token-mean", "seq-mean-token-mean")
# Groupings of a rank's n local sequences into calls, with the config they run under.
GROUPINGS_1 = {
    "growing": [],  # 1, 2, 3 (single process: 6 sequences)
    "one-per-sample": [],
    "uneven-mbs2": ["micro_batch_size=2"],  # calls 3, 2, 1 with micro-batches of 2: partial micro-batches inside calls
    "dynamic": ["max_token_len_per_micro_batch=16"],  # calls 4, 2, each split under a token budget
}
GROUPINGS_2 = {
    "different-per-rank": [],  # DP rank 0 calls 1, 2 ...; DP rank 1 the reverse
    "one-per-sample": ["micro_batch_size=1"],
}


def call_sizes(grouping: str, n: int, dp_rank: int) -> list[int]:
    """The sizes of the calls a rank splits its ``n`` local sequences into."""
    growing, left, k = [], n, 1
    while left:
        growing.append(min(k, left))
        left -= growing[-1]
        k += 1
    return {
        "growing": growing,
        "different-per-rank": growing if dp_rank % 2 == 0 else growing[::-1],
        "uneven-mbs2": growing[::-1],
        "one-per-sample": [1] * n,
        "dynamic": [n - 2, 2],
    }[grouping]


def _mode_overrides(mode: str) -> list[str]:
    return [f"loss_agg_mode={mode}", *([f"loss_agg_constant={CONSTANT}"] if mode == "seq-mean-token-sum-norm" else [])]


# ----------------------------------------------------------------------------- workers (spawned)
def _abort_case(strategy, model_dir, extra) -> dict:
    """Two engines take the same first step; one then accumulates junk over two calls and
    aborts, and again after a call whose loss function raises on the second micro-batch;
    both then take the same second step (the aborted one without another zero_grad)."""
    clean, aborted = new_engine(strategy, model_dir, *extra), new_engine(strategy, model_dir, *extra)
    for engine in (clean, aborted):
        run_window(engine, local_batch(engine, seed=0))
    before = snapshot(aborted)
    junk = local_batch(aborted, seed=5)
    with aborted.train_mode():
        aborted.optimizer_zero_grad()
        aborted.forward_backward_step(junk[:1])
        aborted.forward_backward_step(junk[1:])
        aborted.optimizer_zero_grad()  # the abort
    after_abort = snapshot(aborted)

    calls = []

    def failing_loss(mb, out, norm):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected loss failure")
        return pg_loss(mb, out, norm)

    aborted.set_loss_fn(failing_loss)
    error = None
    with aborted.train_mode():
        try:
            aborted.forward_backward_step(local_batch(aborted, seed=6))
        except RuntimeError as exc:
            error = str(exc)
        aborted.set_loss_fn(pg_loss)
        aborted.optimizer_zero_grad()  # abort after the failed call
    after_failure = snapshot(aborted)

    n = local_batch(clean, seed=1).batch_size[0]
    sizes = [1, n - 1]  # the next window is itself split over two calls
    second = {
        "clean": run_window(clean, local_batch(clean, seed=1), sizes),
        "aborted": run_window(aborted, local_batch(aborted, seed=1), sizes, zero_grad=False),
    }
    return {
        "abort_trace": snapshot_diff(before, after_abort),
        "failure": error,
        "failure_trace": snapshot_diff(before, after_failure),
        "second": second,
        "second_diff": snapshot_diff(snapshot(clean), snapshot(aborted)),
    }


def _one_step(strategy, model_dir, overrides, grouping) -> dict:
    engine = new_engine(strategy, model_dir, *overrides)
    batch = local_batch(engine)
    sizes = call_sizes(grouping, batch.batch_size[0], engine.dp_rank) if grouping else None
    result = run_window(engine, batch, sizes)
    return {"grad_norm": result["grad_norm"], "params": snapshot(engine)["params"], "sizes": sizes}


def accumulation_worker(rank, world, strategy, model_dir, layouts, modes, groupings):
    """Every abort and streaming case of one backend at the given layouts."""
    worker_setup()
    out = {}
    for name, layout in layouts.items():
        for deferred in (False, True):
            extra = [*layout, "micro_batch_size=1", f"deferred_normalization={deferred}"]
            out[("abort", name, deferred)] = _abort_case(strategy, model_dir, extra)
        for mode in modes:
            out[("stream", name, mode, "reference")] = _one_step(strategy, model_dir, [*layout, *_mode_overrides(mode)], None)
            for grouping, extra in groupings.items():
                overrides = [*layout, *_mode_overrides(mode), "deferred_normalization=true", *extra]
                out[("stream", name, mode, grouping)] = _one_step(strategy, model_dir, overrides, grouping)
        reset_layout(strategy)
    return out


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def results(backend, model_dir):
    """{"single": results of the 1-rank run, "ranks": [results of each rank of the 2-rank run]}."""
    single = run(accumulation_worker, 1, backend, model_dir, {"single": []}, AGG_MODES, GROUPINGS_1)[0]
    layouts = two_rank_layouts(backend)
    ranks = run(accumulation_worker, 2, backend, model_dir, layouts, MODES_2RANK, GROUPINGS_2)
    return {"single": single, "ranks": ranks}


# ----------------------------------------------------------------------------- tests
def _aborts(results, deferred):
    """(label, result) of every abort case with this ``deferred`` flag: single process and
    each rank of each 2-rank layout."""
    runs = [("single", results["single"])] + [(f"rank{r}", res) for r, res in enumerate(results["ranks"])]
    for where, res in runs:
        for key, r in res.items():
            if key[0] == "abort" and key[2] == deferred:
                yield f"{where}/{key[1]}", r


@pytest.mark.parametrize("deferred", [False, True], ids=["normal", "deferred"])
def test_abort_leaves_no_trace(results, deferred):
    for label, r in _aborts(results, deferred):
        assert r["abort_trace"] == [], f"{label}: the aborted window changed {r['abort_trace']}"
        assert r["failure"] == "injected loss failure", f"{label}: the failing loss did not raise ({r['failure']})"
        assert r["failure_trace"] == [], f"{label}: the failed call + abort changed {r['failure_trace']}"


@pytest.mark.parametrize("deferred", [False, True], ids=["normal", "deferred"])
def test_window_after_abort_equals_a_run_that_never_saw_the_aborted_data(results, deferred):
    for label, r in _aborts(results, deferred):
        clean, aborted = r["second"]["clean"], r["second"]["aborted"]
        assert math.isfinite(clean["grad_norm"]), label
        assert aborted == clean, f"{label}: losses / grad norm / lr {aborted} vs {clean}"
        assert r["second_diff"] == [], f"{label}: state after the next window differs: {r['second_diff']}"


def _assert_same_step(got, want, label):
    assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=RTOL), f"{label}: grad norm {got['grad_norm']} vs {want['grad_norm']}"
    assert rel_diff(got["params"], want["params"]) <= RTOL, f"{label}: params differ by {rel_diff(got['params'], want['params']):.2e}"


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("grouping", list(GROUPINGS_1))
def test_streamed_calls_equal_one_call_single_process(results, mode, grouping):
    single = results["single"]
    got = single[("stream", "single", mode, grouping)]
    assert len(got["sizes"]) > 1, got["sizes"]
    _assert_same_step(got, single[("stream", "single", mode, "reference")], f"{mode}/{grouping} calls {got['sizes']}")


@pytest.mark.parametrize("mode", MODES_2RANK)
@pytest.mark.parametrize("grouping", list(GROUPINGS_2))
def test_streamed_calls_equal_one_call_two_ranks(results, backend, mode, grouping):
    solo = results["single"][("stream", "single", mode, "reference")]
    for layout in two_rank_layouts(backend):
        for rank, res in enumerate(results["ranks"]):
            got, label = (
                res[("stream", layout, mode, grouping)],
                f"{layout}/rank{rank} calls {res[('stream', layout, mode, grouping)]['sizes']}",
            )
            _assert_same_step(got, res[("stream", layout, mode, "reference")], label)
            # The 2-rank step is also the single-process step of the same global batch
            # (relative 1e-5: a different reduction order across ranks).
            assert rel_diff(got["params"], solo["params"]) <= 1e-5, f"{label} vs single process"
