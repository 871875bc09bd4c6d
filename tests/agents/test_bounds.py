"""What bounds a multi-turn rollout's user code (issue 60): observations cut before the template
runs, tools stopped past their time and run concurrently, each trajectory's own copy of its row,
the calculator sized before it computes, and the environment's answers checked and named.

Each test was shown failing on the code before the fix (or on the injected bug its docstring
names). The scripted rollout, tokenizers and templates are ``test_trajectories``'s.
"""

from __future__ import annotations

import json
import time

import numpy as np
import psutil
import pytest
import torch

from engine_api.rollout import Sample, sample_seed
from posttrain.agents import AgentRun, StepResult, parse_tool_calls
from posttrain.agents.builtin_tools import calculator
from posttrain.agents.tool_runner import Tool, ToolRunner
from posttrain.agents.tools import ToolCall
from tests.agents import light_tools
from tests.agents.scripted import HERMES, Scripted, _chat_tokenizer, _loop, _meta

LIGHT = "tests.agents.light_tools"


def _tool(name: str, isolated: bool = True) -> Tool:
    return Tool(name, getattr(light_tools, name), f"{LIGHT}:{name}" if isolated else None)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ---------------------------------------------------------------------------------- tools
def test_a_tool_past_its_time_is_stopped_even_holding_the_gil():
    """A busy loop and one C call holding the GIL (``7 ** 10**8``, minutes) are both stopped at
    the limit: their worker processes are killed, nothing of them keeps running, and the next
    call gets a fresh worker. (Before: abandoned threads that kept a core each for the rest of
    the run; the GIL-holding one could not even be abandoned in time.)"""
    runner = ToolRunner(timeout_s=0.5, concurrency=2)
    try:
        before = _children()
        calls = [ToolCall("spin", {"seconds": 600}), ToolCall("hold_gil", {"digits": 10**8})]
        registry = {"spin": _tool("spin"), "hold_gil": _tool("hold_gil")}
        out = runner.run([(c, registry) for c in calls], [100, 100])
        assert [r.error for r in out] == [True, True]
        assert all("did not return within 0.5 s; it was stopped" in r.content for r in out), out
        assert _children() <= before  # both workers are gone, with anything they started
        ok = runner.run([(ToolCall("pid", {}), {"pid": _tool("pid")})], [100])[0]
        assert not ok.error and int(ok.content) in _children()  # a fresh worker serves the next call
    finally:
        runner.close()
    assert not (_children() - before)


def test_a_turns_calls_run_concurrently_under_a_cap_and_a_deadline():
    """Four 1-second calls at concurrency 4 overlap (one turn costs one call's time, not four);
    at concurrency 1 with a 1.5-second turn deadline the first finishes, the second is stopped
    at the deadline and the rest never start, each an error observation naming why."""
    registry = {"sleepy": _tool("sleepy")}
    runner = ToolRunner(timeout_s=30, concurrency=4)
    try:
        runner.run([(ToolCall("sleepy", {"seconds": 0.0}), registry)] * 4, [100] * 4)  # start the workers
        began = time.monotonic()
        out = runner.run([(ToolCall("sleepy", {"seconds": 1.0}), registry)] * 4, [100] * 4)
        assert [r.content for r in out] == ["slept"] * 4
        assert time.monotonic() - began < 3.0  # serial would be >= 4 s (a wide margin on a busy machine)
    finally:
        runner.close()
    runner = ToolRunner(timeout_s=30, concurrency=1, turn_timeout_s=1.5)
    try:
        out = runner.run([(ToolCall("sleepy", {"seconds": 1.0}), registry)] * 4, [100] * 4)
        assert out[0].content == "slept"
        assert "the turn's deadline" in out[1].content and out[1].error
        assert all("not run: the turn's tool calls ran past their deadline" in r.content for r in out[2:])
    finally:
        runner.close()


def test_abandoned_thread_calls_are_counted_and_stop_the_run_past_the_bound():
    """Tools that cannot move to a process (thread isolation) are abandoned past their time;
    past ``env.max_abandoned_tools`` still running, the run stops naming the tool."""
    runner = ToolRunner(timeout_s=0.2, concurrency=4, isolation="thread", max_abandoned=2)
    registry = {"sleepy": _tool("sleepy", isolated=False)}
    out = runner.run([(ToolCall("sleepy", {"seconds": 3}), registry)] * 2, [100] * 2)
    assert all(r.error and "did not return within 0.2 s" in r.content for r in out)
    with pytest.raises(RuntimeError, match=r"3 tool calls .* \(tools 'sleepy'\), above env.max_abandoned_tools = 2"):
        runner.run([(ToolCall("sleepy", {"seconds": 3}), registry)], [100])


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_a_result_whose_str_raises_or_is_huge_is_an_observation_not_a_crash(isolation):
    runner = ToolRunner(timeout_s=10, concurrency=2, isolation=isolation)
    try:
        registry = {"unprintable": _tool("unprintable"), "huge": _tool("huge")}
        bad, big = runner.run([(ToolCall("unprintable", {}), registry), (ToolCall("huge", {"size": 10**6}), registry)], [50, 50])
    finally:
        runner.close()
    assert bad.error and "RuntimeError: no text for you" in bad.content
    assert (big.content, big.truncated, big.error) == ("x" * 50, True, False)


def test_the_calculator_sizes_a_power_tower_before_computing_it():
    """``((((10**64)**64)**64)**64)`` held the GIL for a minute (one more level: hours); each
    integer power and product is sized first (the test's own timeout is the bound it would hit)."""
    for tower in ("((((10**64)**64)**64)**64)", "(10**600) * (10**600)", "(2**3000) ** 2"):
        with pytest.raises(ValueError, match="bits"):
            calculator(tower)
    assert calculator("10 ** 1000") == "1" + "0" * 1000 and calculator("2 ** 0.5").startswith("1.414")
    assert calculator("(-3) ** 3") == "-27" and calculator("2 ** -2") == "0.25"


def test_llama31_calls_split_on_semicolons_between_calls_only():
    text = '{"name": "search", "parameters": {"q": "a; b"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
    calls = parse_tool_calls(text, "llama3")
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [("search", {"q": "a; b"}, None), ("add", {"a": 1, "b": 2}, None)]
    assert parse_tool_calls('{"name": "s", "parameters": {"q": ";"}}', "llama3")[0].arguments == {"q": ";"}
    broken = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": ', "llama3")
    assert broken[0].error is None and "not valid JSON" in broken[1].error


# ---------------------------------------------------------------------------------- observations
class Floods:
    """Answers every turn with an observation of ``size`` characters (never done)."""

    size = 2_000_000

    def __init__(self, prompt: str, **columns) -> None:
        pass

    def step(self, turn):
        return StepResult("y" * self.size, 0.0, False)


def test_an_observation_is_cut_before_the_template_runs_and_changes_no_trajectory(monkeypatch):
    """A 2 MB observation reaches the template cut to ``env.max_observation_chars`` (by default
    more than ``env.max_tokens`` can use, so the trajectory ends at the budget exactly as the
    whole observation would end it); counted in ``env/observations_truncated``. (Before: rendered
    and tokenized whole, seconds and gigabytes, then dropped at the budget.)"""
    import posttrain.agents.loop as loop_module

    tok = _chat_tokenizer(HERMES)
    longest = []
    plain = loop_module._renderer

    def spy(tokenizer, tools, kwargs):
        render = plain(tokenizer, tools, kwargs)

        def recorded(messages):
            longest.append(max(len(m["content"]) for m in messages))
            return render(messages)

        return recorded

    monkeypatch.setattr(loop_module, "_renderer", spy)
    policy = lambda prompt: "ab"  # noqa: E731
    loop = _loop(tok, function=f"{__name__}:Floods")
    out = loop.run(Scripted(tok, policy), [_meta("key 1")], [0], max_new_tokens=8)
    assert max(longest) <= loop.max_observation_chars < Floods.size
    assert out.metrics["env/observations_truncated"] == 1 and out.batch["rollout_truncated"].tolist() == [1]
    monkeypatch.setattr(Floods, "size", 300)  # small enough to render whole: the same trajectory
    whole = _loop(tok, function=f"{__name__}:Floods", max_observation_chars=10**7).run(Scripted(tok, policy), [_meta("key 1")], [0], 8)
    assert torch.equal(whole.batch["input_ids"].values(), out.batch["input_ids"].values())
    assert whole.metrics["env/observations_truncated"] == 0
    # An explicit, small bound: the model sees the first characters and goes on.
    cut = _loop(tok, function=f"{__name__}:Floods", max_observation_chars=5, max_turns=2).run(Scripted(tok, policy), [_meta("k")], [0], 8)
    assert "<|im_start|>user\nyyyyy<|im_end|>" in tok.decode(cut.batch["input_ids"][0].tolist())
    with pytest.raises(ValueError, match=r"env.function = '.*Floods' \(row test.jsonl:k\), turn 0: the observation has more than"):
        _loop(tok, function=f"{__name__}:Floods", max_observation_chars=5, observation_overflow="error").run(
            Scripted(tok, policy), [_meta("k")], [0], 8
        )


class Appends:
    """Appends to the row's list column, and scores what it saw first."""

    def __init__(self, prompt: str, seen: list, **columns) -> None:
        self.first = len(seen)
        seen.append("mine")

    def step(self, turn):
        return StepResult(None, float(self.first), True)


def test_each_trajectory_gets_its_own_copy_of_the_row():
    """Two trajectories of one row: each environment sees the row as the data has it (an append
    by the first reached the second, the reward function and the next epoch before)."""
    tok = _chat_tokenizer(HERMES)
    row = _meta("k", seen=[])
    seen_by_reward = []

    def reward(prompt, response, seen):
        seen_by_reward.append(list(seen))
        return 0.0

    loop = _loop(tok, function=f"{__name__}:Appends")
    loop.reward = (reward, "reward", False, None)
    out = loop.run(Scripted(tok, lambda p: "a"), [row, row], [0, 1], max_new_tokens=4)
    assert out.scores.tolist() == [0.0, 0.0]  # neither saw the other's append
    assert seen_by_reward == [[], []] and row.columns["seen"] == []


# ---------------------------------------------------------------------------------- answers checked
class Answers:
    """Returns ``Answers.result`` at every turn."""

    result: object = None

    def __init__(self, prompt: str, **columns) -> None:
        pass

    def step(self, turn):
        return Answers.result


@pytest.mark.parametrize(
    "result, needle",
    [
        (StepResult(None, 1.0, True, tool_errors="many"), "tool_errors = 'many' is not an integer >= 0"),
        (StepResult(None, 1.0, True, tool_errors=-1000), "tool_errors = -1000 is not an integer >= 0"),
        (StepResult("\ud800 bad", 0.0, False), "turn 0: observation message 0 holds '\\ud800' at character 0"),
        (StepResult({"role": "robot", "content": "hi"}, 0.0, False), "turn 0: the chat template or tokenizer could not take"),
    ],
)
def test_bad_answers_are_named_with_the_environment_the_row_and_the_turn(monkeypatch, result, needle):
    refuses_robots = HERMES.replace(
        "{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'robot' %}{{ raise_exception('no robots') }}{% endif %}"
    )
    tok = _chat_tokenizer(refuses_robots)
    monkeypatch.setattr(Answers, "result", result)
    with pytest.raises(ValueError, match="env.function") as err:
        _loop(tok, function=f"{__name__}:Answers").run(Scripted(tok, lambda p: "a"), [_meta("k")], [0], max_new_tokens=4)
    assert needle in str(err.value) and "row test.jsonl:k" in str(err.value)


def test_numpy_scalar_rewards_are_numbers():
    tok = _chat_tokenizer(HERMES)
    for value in (np.float32(0.5), np.int64(2), np.float64(0.25)):
        Answers.result = StepResult(None, value, True)
        out = _loop(tok, function=f"{__name__}:Answers").run(Scripted(tok, lambda p: "a"), [_meta("k")], [0], max_new_tokens=4)
        assert out.scores.tolist() == [float(value)]


# ---------------------------------------------------------------------------------- versions and seeds
class Versioned(Scripted):
    """Scripted, its weight version raised by one at every call (a pipeline that syncs between
    turns); records each call's seeds."""

    def __init__(self, tok, policy) -> None:
        super().__init__(tok, policy)
        self.version, self.seeds = 0, []

    def sample(self, prompts, seeds, kept=None, max_new_tokens=None):
        self.version += 1
        self.seeds.append(list(seeds))
        return [
            Sample(s.token_ids, s.log_probs, s.finish_reason, self.version) for s in super().sample(prompts, seeds, kept, max_new_tokens)
        ]


class TwoTurns:
    def __init__(self, prompt: str, **columns) -> None:
        pass

    def step(self, turn):
        return StepResult(None, 1.0, True) if turn.index else StepResult("obs", 0.0, False)


def test_a_trajectorys_staleness_counts_from_its_oldest_token_and_each_turn_has_its_own_seed():
    """A trajectory whose turns were sampled by versions 1 and 2 is as old as version 1 (a
    ``max`` in its place hides a stale first turn from the staleness bound); turn ``t`` of the
    trajectory seeded ``s`` is seeded ``sample_seed(s, t)`` (the first turn's seed at every turn
    passes every other test)."""
    tok = _chat_tokenizer(HERMES)
    rollout = Versioned(tok, lambda p: "a")
    out = _loop(tok, function=f"{__name__}:TwoTurns").run(rollout, [_meta("k"), _meta("j")], [7, 9], max_new_tokens=4)
    batch = out.batch
    for row in range(2):  # each trajectory's turns come from successive calls, so from two versions
        versions = batch["rollout_token_versions"][row][batch["loss_mask"][row] > 0]
        assert versions.min() < versions.max() and int(batch["rollout_weight_version"][row]) == int(versions.min())
    # Per-trajectory scheduling serves calls as they come: which calls share a rollout call may
    # vary, the seeds may not.
    assert sorted(s for call in rollout.seeds for s in call) == sorted(sample_seed(s, t) for s in (7, 9) for t in (0, 1))


def test_a_paused_runs_log_probs_and_versions_are_covered_on_resume(capsys):
    """A paused batch's saved log-probs are in its digest (an edited one regenerates the batch,
    warned, instead of training numbers the rollout never produced), and versions outside what
    the checkpoint's step can hold are refused when read."""
    tok = _chat_tokenizer(HERMES)
    metas = [_meta("ab"), _meta("abc")]
    loop = _loop(tok, function=f"{__name__}:TwoTurns")
    run = loop.start(metas, [1, 2])
    loop.advance(Scripted(tok, lambda p: "a"), run, 8, turns=1)
    tensors, meta = run.to_tensors()
    meta = json.loads(json.dumps(meta))
    assert loop.replay(AgentRun.from_tensors(tensors, meta, max_version=1), metas) is not None
    edited = dict(tensors, log_probs=tensors["log_probs"] - 0.5)
    assert loop.replay(AgentRun.from_tensors(edited, meta, max_version=1), metas) is None
    assert "does not replay: trajectory 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"weight versions 1..1, outside 0..0"):
        AgentRun.from_tensors(tensors, meta, max_version=0)
    with pytest.raises(ValueError, match="log-probs that are not finite numbers <= 0"):
        AgentRun.from_tensors(dict(tensors, log_probs=tensors["log_probs"] + 5), meta, max_version=1)


def test_a_raising_environment_is_reported_by_its_own_line_not_a_traceback(capsys, monkeypatch):
    """Issue 60 item 11: the command prints the summary and the user's frame (it printed a
    59-line traceback through the library on every rank); ``ENGINEKIT_TRACEBACK=1`` keeps it all."""
    from posttrain.trainer_utils import run_cli
    from tests.agents import scripted

    tok = _chat_tokenizer(HERMES)
    loop = _loop(tok, function="tests.agents.scripted:Raises")
    monkeypatch.delenv("ENGINEKIT_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as stop:
        run_cli(lambda: loop.run(Scripted(tok, lambda p: "a"), [_meta("k")], [0], max_new_tokens=4))
    err = capsys.readouterr().err
    assert stop.value.code == 1
    assert "error: env.function = 'tests.agents.scripted:Raises' (row test.jsonl:k), turn 0: raised KeyError('boom')" in err
    assert f'File "{scripted.__file__}"' in err and 'raise KeyError("boom")' in err
    assert len(err.strip().splitlines()) == 4, err  # summary, frame, its source line, the hint
