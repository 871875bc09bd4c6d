"""Multi-turn trajectories kept token in, token out (``posttrain.agents``; issue 54), on real HF
tokenizers and chat templates with a scripted policy in place of the rollout (the rollout role's
``sample`` interface: what the loop calls). No engine: the engine runs are in
``test_agent_runs.py``.

What must hold, each shown failing on a broken implementation once:

* the trained tokens ARE the sampled ones, with a tokenizer whose decode-then-encode is not the
  identity (a re-encoding loop trains other tokens: the test compares ids);
* the loss mask is 1 exactly on the sampled tokens; prompts, template glue and observations
  (tool results) are 0;
* a template that strips earlier reasoning is refused by default, naming the turn and the
  token; with ``history_mismatch=split`` the next turns start a new sample whose prompt is the
  re-rendered conversation;
* the token budget ends a trajectory, flagged truncated, never cut mid-observation;
* malformed tool calls, unknown tools and failing tools are error observations, counted;
  a broken environment (raises, hangs, returns a non-string observation) stops the step naming
  ``env.function``.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch

from posttrain.agents import EnvConfig, HistoryMismatch, StepResult, parse_tool_calls
from posttrain.agents.demo import TEMPLATE, character_tokenizer
from posttrain.agents.tools import run_tool
from tests.agents.scripted import (
    HERMES,
    STRIPS_REASONING,
    Raises,
    Scripted,
    _bpe_tokenizer,
    _chat_tokenizer,
    _loop,
    _meta,
    _sampled_in_rows,
)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def test_hermes_and_llama3_calls_parse_and_malformed_ones_are_named():
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y', "hermes")
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None)]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', "hermes")[0].arguments == {"a": 1}
    bad = parse_tool_calls("<tool_call>{name: add}</tool_call><tool_call>[1]</tool_call><tool_call>{", "hermes")
    assert [c.error is not None for c in bad] == [True, True, True]
    assert "not valid JSON" in bad[0].error and "not an object" in bad[1].error and "closing" in bad[2].error
    llama = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3")
    assert [(c.name, dict(c.arguments)) for c in llama] == [("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("The answer is 3.", "llama3") == []
    assert parse_tool_calls('{"name": 3}', "llama3")[0].error == "the call has no string 'name'"


def test_failing_tools_become_counted_error_observations():
    def exits():
        sys.exit(3)

    def sleeps():
        time.sleep(5)

    registry = {"add": add, "exits": exits, "sleeps": sleeps, "boom": lambda: 1 / 0}
    ok = run_tool(parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "hermes")[0], registry, 5)
    assert (ok.content, ok.error) == ("3", False)
    for text, needle in [
        ('{"name": "nope", "arguments": {}}', "unknown tool 'nope'"),
        ('{"name": "add", "arguments": {"a": 1}}', "bad arguments for 'add'"),
        ('{"name": "exits", "arguments": {}}', "raised SystemExit"),
        ('{"name": "boom", "arguments": {}}', "ZeroDivisionError"),
        ('{"name": "sleeps", "arguments": {}}', "did not return within 0.2 s"),
        ('{"name": "add", "arguments": [1]}', "malformed tool call"),
    ]:
        result = run_tool(parse_tool_calls(f"<tool_call>{text}</tool_call>", "hermes")[0], registry, 0.2)
        assert result.error and needle in result.content, result


class Echo:
    """Answers every turn with an observation until ``turns`` turns, then done (reward 1)."""

    def __init__(self, prompt: str, turns: int = 2, **columns) -> None:
        self.turns = turns

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult("obs ab", 0.25, False)


def test_the_trained_tokens_are_the_sampled_ones_with_a_tokenizer_that_does_not_round_trip():
    tok = _bpe_tokenizer()
    rollout = Scripted(tok, lambda prompt: "abab", split_pieces=True)
    loop = _loop(tok, function=f"{__name__}:Echo", max_turns=3)
    out = loop.run(rollout, [_meta("ab"), _meta("abc")], [1, 2], max_new_tokens=8)
    _sampled_in_rows(out, rollout)
    per_row = [out.batch["input_ids"][i][out.batch["loss_mask"][i] > 0].tolist() for i in range(2)]
    a, b = tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert per_row == [[a, b, a, b, end] * 2] * 2  # two turns of the split draw, never re-encoded to 'ab'
    # The second turn's prompt continued from the kept ids: the first turn's split tokens are in it.
    second_prompt = rollout.calls[1][0]
    assert rollout.calls[0][0] == [a, b, a, b, end] and second_prompt == [a, b, a, b, end]
    assert out.scores.tolist() == [1.25, 1.25] and out.metrics["env/turns_max"] == 2
    # Each turn's tokens carry their own log-probs and turn index.
    turns = out.turns[out.batch["loss_mask"].values() > 0]
    assert turns.tolist() == ([0] * 5 + [1] * 5) * 2


class Drifts(Echo):
    """Echo whose observations differ from one instance to the next (not deterministic)."""

    built = 0

    def __init__(self, prompt: str, turns: int = 2, **columns) -> None:
        super().__init__(prompt, turns)
        Drifts.built += 1
        self.mark = Drifts.built

    def step(self, turn):
        out = super().step(turn)
        return out if out.done else StepResult(f"obs {self.mark}", out.reward, False)


def test_a_run_paused_between_turns_resumes_from_its_checkpoint_as_if_never_paused(capsys):
    """The asynchronous pipeline pauses trajectories between turns and checkpoints only their
    kept samples: replayed through fresh environments (a new process's loop) and continued,
    the batch equals the unpaused run's, and nothing is sampled twice. An environment that
    answers differently on replay is caught by the saved digests: warned, and the batch is
    generated again (None), never spliced."""
    from posttrain.agents import AgentRun

    tok = _chat_tokenizer(HERMES)
    metas = [_meta("ab", turns=1), _meta("abc", turns=3), _meta("b", turns=2)]

    def policy(prompt: str) -> str:
        return str(len(prompt) % 7)

    whole = _loop(tok, function=f"{__name__}:Echo").run(Scripted(tok, policy), metas, [1, 2, 3], 8)
    loop = _loop(tok, function=f"{__name__}:Echo")
    run = loop.start(metas, [1, 2, 3])
    loop.advance(Scripted(tok, policy), run, 8, turns=1)
    assert (run.turn, run.finished) == (1, False)
    tensors, meta = run.to_tensors()
    saved = AgentRun.from_tensors(tensors, json.loads(json.dumps(meta)))
    fresh = _loop(tok, function=f"{__name__}:Echo")
    rollout = Scripted(tok, policy)
    out = fresh.run(rollout, metas, [1, 2, 3], 8, state=fresh.replay(saved, metas))
    assert sum(len(call) for call in rollout.calls) == 3  # turns 1 (two trajectories) and 2 (one): turn 0 was not sampled again
    for key in ("input_ids", "loss_mask", "rollout_log_probs", "rollout_token_versions"):
        assert torch.equal(out.batch[key].values(), whole.batch[key].values()), key
    assert out.scores.tolist() == whole.scores.tolist() and out.metrics == whole.metrics

    drifting = _loop(tok, function=f"{__name__}:Drifts")
    run = drifting.start(metas, [1, 2, 3])
    drifting.advance(Scripted(tok, policy), run, 8, turns=1)
    tensors, meta = run.to_tensors()
    assert drifting.replay(AgentRun.from_tensors(tensors, meta), metas) is None
    assert "does not replay: trajectory 1" in capsys.readouterr().err


def test_tool_results_are_never_in_the_loss_mask():
    tok = _chat_tokenizer(HERMES)

    def policy(prompt: str) -> str:
        if prompt.count("<|im_start|>assistant") == 1:
            return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
        return "5"

    rollout = Scripted(tok, policy)
    loop = _loop(tok, tools=["tests.agents.light_tools:add"])
    assert loop.fmt == "hermes"  # read off the template
    out = loop.run(rollout, [_meta("key 1")], [0], max_new_tokens=80)
    ids, mask = out.batch["input_ids"][0], out.batch["loss_mask"][0]
    text = tok.decode(ids.tolist())
    assert "<|im_start|>tool\n5<|im_end|>" in text  # the tool ran and its result was rendered
    masked_text = tok.decode(ids[mask > 0].tolist())
    assert masked_text == '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>5<|im_end|>'
    _sampled_in_rows(out, rollout)
    assert out.metrics["env/tool_calls_mean"] == 1 and out.metrics["env/tool_errors_sum"] == 0
    assert out.metrics["env/turns_mean"] == 2 and out.metrics["env/truncated_frac"] == 0


def test_malformed_and_unknown_calls_reach_the_model_as_errors_and_are_counted():
    tok = _chat_tokenizer(HERMES)
    answers = iter(['<tool_call>{"name": add}</tool_call>', '<tool_call>{"name": "sub", "arguments": {}}</tool_call>', "1"])
    rollout = Scripted(tok, lambda prompt: next(answers))
    out = _loop(tok).run(rollout, [_meta("key 1")], [0], max_new_tokens=80)
    text = tok.decode(out.batch["input_ids"][0].tolist())
    assert "Error: malformed tool call: the call is not valid JSON" in text and "Error: unknown tool 'sub'" in text
    assert out.metrics["env/tool_errors_sum"] == 2 and out.metrics["env/tool_calls_mean"] == 2


def test_a_template_that_strips_reasoning_is_refused_or_split():
    tok = _chat_tokenizer(STRIPS_REASONING, "<think>", "</think>")
    policy = lambda prompt: "<think>hm</think>ab"  # noqa: E731
    with pytest.raises(HistoryMismatch, match="renders the conversation before assistant turn 1 differently") as err:
        _loop(tok, function=f"{__name__}:Echo").run(Scripted(tok, policy), [_meta("key 1")], [0], max_new_tokens=20)
    assert "assistant turn 0" in str(err.value) and "'<think>'" in str(err.value)
    rollout = Scripted(tok, policy)
    out = _loop(tok, function=f"{__name__}:Echo", history_mismatch="split").run(rollout, [_meta("key 1")], [0], max_new_tokens=20)
    assert len(out.batch["input_ids"]) == 2 and out.traj_of_row.tolist() == [0, 0] and out.metrics["env/split_frac"] == 1
    _sampled_in_rows(out, rollout)
    second = tok.decode(out.batch["input_ids"][1].tolist())
    # The new sample's prompt is the re-rendered conversation: the first turn without its reasoning.
    assert second.startswith("<|im_start|>user\nkey 1<|im_end|>\n<|im_start|>assistant\nab<|im_end|>")
    assert tok.decode(out.batch["input_ids"][1][out.batch["loss_mask"][1] > 0].tolist()) == "<think>hm</think>ab<|im_end|>"


def test_the_token_budget_ends_a_trajectory_flagged_truncated():
    tok = character_tokenizer()
    tok.chat_template = TEMPLATE

    def length(messages) -> int:
        return len(
            tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        )

    prompt = [{"role": "user", "content": "key 1"}]
    after_obs = length([*prompt, {"role": "assistant", "content": "1234"}, {"role": "user", "content": "obs ab"}])
    budget = after_obs  # the observation would leave no room for one sampled token
    rollout = Scripted(tok, lambda p: "1234")
    out = _loop(tok, function=f"{__name__}:Echo", max_tokens=budget).run(rollout, [_meta("key 1")], [0], max_new_tokens=8)
    assert out.metrics["env/truncated_frac"] == 1 and out.batch["rollout_truncated"].tolist() == [1]
    assert len(out.batch["input_ids"][0]) == length(prompt) + 5 and out.metrics["env/turns_max"] == 1
    # One more token of budget: the observation fits and the second turn samples.
    out = _loop(tok, function=f"{__name__}:Echo", max_tokens=budget + 6).run(Scripted(tok, lambda p: "1234"), [_meta("key 1")], [0], 8)
    assert out.metrics["env/turns_max"] == 2 and out.metrics["env/truncated_frac"] == 0
    # A turn capped by the budget: it samples only what is left.
    cap = length(prompt) + 5
    out = _loop(tok, function=f"{__name__}:Echo", max_tokens=cap).run(Scripted(tok, lambda p: "123456789"), [_meta("key 1")], [0], 8)
    assert len(out.batch["input_ids"][0]) == cap and out.batch["rollout_truncated"].tolist() == [1]


class Hangs(Raises):
    def step(self, turn):
        time.sleep(5)


class NotText(Raises):
    def step(self, turn):
        return StepResult({"role": "user", "content": 5}, 0.0, False)


class Exits(Raises):
    def step(self, turn):
        sys.exit(1)


@pytest.mark.parametrize(
    "env, needle",
    [
        ("Raises", "raised KeyError('boom')"),
        ("Hangs", "did not return within env.step_timeout_s = 0.2 s"),
        ("NotText", "the observation is a dict"),
        ("Exits", "raised SystemExit(1)"),
    ],
)
def test_a_broken_environment_stops_the_step_naming_it(env, needle):
    tok = character_tokenizer()
    tok.chat_template = TEMPLATE
    loop = _loop(tok, function=f"{__name__}:{env}", step_timeout_s=0.2)
    with pytest.raises((RuntimeError, ValueError), match="env.function") as err:
        loop.run(Scripted(tok, lambda p: "1"), [_meta("key 1")], [0], max_new_tokens=4)
    assert needle in str(err.value) and "test.jsonl:key 1" in str(err.value)


def test_bad_env_settings_are_named():
    problems = EnvConfig(function="nomodule", max_turns=0, tool_format="xml", history_mismatch="guess", tool_timeout_s=0)._problems()
    text = "; ".join(problems)
    for needle in ("function = 'nomodule'", "max_turns = 0", "tool_format = 'xml'", "history_mismatch = 'guess'", "tool_timeout_s = 0"):
        assert needle in text, text
    tok = character_tokenizer()
    tok.chat_template = TEMPLATE  # names neither tool-call form
    with pytest.raises(ValueError, match="env.tool_format = 'auto'"):
        _loop(tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        _loop(tok, tool_format="hermes")
    tok.chat_template = HERMES
    with pytest.raises(ValueError, match="tool 'run_tool': no schema"):  # no docstring Args for its parameters
        _loop(tok, tools=["posttrain.agents.tools:run_tool"])


def test_the_recipe_refuses_what_multi_turn_cannot_run(tmp_path):
    from engine_api.typed_config import load_typed
    from recipes.ppo import PPOConfig

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "x"}) + "\n")
    over = [f"data.train_files=[{data}]", f"engine.model.path={tmp_path}", "env.function=tools"]
    for extra, needle in [
        (["trainer.use_legacy_worker_impl=enable"], "legacy workers train single-turn"),
        (["rollout.max_model_len=64", "env.max_tokens=128"], "env.max_tokens = 128 > rollout.max_model_len = 64"),
    ]:
        with pytest.raises(ValueError, match="env") as err:
            load_typed(PPOConfig, "configs/grpo_tiny.yaml", [*over, *extra])
        assert needle in str(err.value)


def test_a_trajectory_budget_over_the_rollout_engines_context_is_refused_before_any_engine(tmp_path):
    """vLLM holds at most the model's ``max_position_embeddings`` (128 for the demo model): a
    larger ``env.max_tokens`` is refused from the model's files, before the data or any engine."""
    from engine_api.rollout_registry import rollout_installed
    from engine_api.typed_config import load_typed
    from posttrain.agents.demo import build_assets
    from recipes.ppo import PPOConfig, rollout_model_problems

    if not rollout_installed("vllm"):
        pytest.skip("vllm not installed (make test installs it)")
    assets = build_assets(tmp_path / "assets", rows=4)
    over = [f"engine.model.path={assets}/model", f"data.train_files=[{assets}/train.jsonl]", f"data.val_files=[{assets}/val.jsonl]"]
    over.append("rollout.backend=vllm")
    cfg = load_typed(PPOConfig, "configs/agent_tiny.yaml", [*over, "env.max_tokens=256", "data.max_prompt_length=16"])
    assert any("env.max_tokens = 256 > the rollout engine's max_model_len 128" in p for p in rollout_model_problems(cfg))
    cfg = load_typed(PPOConfig, "configs/agent_tiny.yaml", [*over, "env.max_tokens=128", "data.max_prompt_length=16"])
    assert rollout_model_problems(cfg) == []
    # The hf backend runs past the model's positions without an error: refused from config.json too (issue 60 item 9).
    cfg = load_typed(PPOConfig, "configs/agent_tiny.yaml", [*over[:-1], "env.max_tokens=256", "data.max_prompt_length=16"])
    assert any("env.max_tokens = 256 > the model's max_position_embeddings 128" in p for p in rollout_model_problems(cfg))


# Llama 3.1's turn markup (header tokens, <|eot_id|>, tool results as the ipython role) with its
# JSON tool calls; the template names <|python_tag|>, so `auto` reads the llama3 form off it.
LLAMA31 = (
    "{% for m in messages %}<|start_header_id|>{% if m['role'] == 'tool' %}ipython{% else %}{{ m['role'] }}{% endif %}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}{# <|python_tag|> #}"
)


def test_llama31_json_tool_calls_run_through_the_loop():
    from tokenizers import AddedToken

    from tinker_server.demo import character_tokenizer as ascii_tokenizer

    tok = ascii_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.add_tokens([AddedToken("<|python_tag|>", special=False, normalized=False)])
    tok.chat_template = LLAMA31
    answers = iter(['{"name": "add", "parameters": {"a": 2, "b": 3}}', "5"])
    rollout = Scripted(tok, lambda prompt: next(answers), stop="<|eot_id|>")
    loop = _loop(tok, stop="<|eot_id|>", tools=["tests.agents.light_tools:add"], max_tokens=512)
    assert loop.fmt == "llama3"
    out = loop.run(rollout, [_meta("2+3?")], [0], max_new_tokens=80)
    ids, mask = out.batch["input_ids"][0], out.batch["loss_mask"][0]
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>" in tok.decode(ids.tolist())
    assert tok.decode(ids[mask > 0].tolist()) == '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>5<|eot_id|>'
    assert out.metrics["env/tool_calls_mean"] == 1 and out.metrics["env/tool_errors_sum"] == 0 and out.metrics["env/turns_max"] == 2
