"""The OpenAI-compatible gateway (issue 62; ``posttrain.gateway``) with real agents in worker
processes (the ``openai`` SDK against the session URL) and a scripted policy in place of the
rollout (its ``sample``: what the scheduler calls). No engine: the recipe runs are in
``test_gateway_runs.py``.

What must hold, each shown failing on a broken gateway once:

* exactness: the trained ids of a session are exactly the ids sampled, in order, with loss mask 1
  on them and 0 on everything else (the system prompt, the tool results, the template's glue),
  although the agent sends the conversation back re-serialised by the SDK (tool calls as JSON
  strings); with a tokenizer whose decode-then-encode is not the identity too;
* a session's tokens are never another's;
* a history the agent rewrote is refused (``env.history_mismatch=error``, a 400 the agent sees)
  or split (``split``);
* faults: an agent that raises, exits, hangs past ``agent.timeout_s``, or never calls the model is
  a counted failure, its group dropped (``drop_group``) or only it (``drop_session``), never a
  zero reward;
* bad requests: an unknown session, a body past the limit, ``n`` > 1, a tool message for an
  unknown call id, thousands of requests without a model call: OpenAI-style errors, the run
  goes on.
"""

from __future__ import annotations

import json
import types
import urllib.error
import urllib.request

import pytest
import torch

from posttrain.agents.config import EnvConfig
from posttrain.gateway.config import AgentConfig
from posttrain.gateway.producer import GatewayProducer
from posttrain.rewards import RewardConfig, math_answer
from roles.rollout import RolloutConfig
from tests.agents.scripted import HERMES, Scripted, _chat_tokenizer, _meta

AGENTS = "tests/gateway/agents.py"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def _calculator_policy(prompt: str) -> str:
    """Call the calculator first, answer with its result after (naming the question's first
    letter, so two sessions' answers differ)."""
    if prompt.count("<|im_start|>assistant") == 1:
        return CALL
    return f"{prompt.split('<|im_start|>user' + chr(10), 1)[1][0]}: \\boxed{{5}}"


def _producer(tok, spec: str, tmp_path, *, reward=True, n=1, **settings) -> GatewayProducer:
    source = types.SimpleNamespace(
        tokenizer=tok, stop_ids=[tok.convert_tokens_to_ids("<|im_end|>")], reward_fn=math_answer if reward else None
    )
    agent_cfg = AgentConfig(function=spec, max_concurrency=4, timeout_s=settings.pop("timeout_s", 60.0), **settings.pop("agent", {}))
    env = EnvConfig(
        max_tokens=settings.pop("max_tokens", 256), history_mismatch=settings.pop("history_mismatch", "error"), tool_format="hermes"
    )
    data = types.SimpleNamespace(chat_template_kwargs={})
    reward_cfg = RewardConfig(function="math_answer" if reward else None)
    return GatewayProducer(agent_cfg, env, reward_cfg, RolloutConfig(max_new_tokens=64), data, source, str(tmp_path / "logs"), n)


def _run(producer: GatewayProducer, rollout, metas, seeds):
    work = producer.start(0, [torch.zeros(1, dtype=torch.long)] * len(metas), metas, seeds)
    producer.advance(rollout, [(work, None)])
    assert producer.finished(work)
    return work, producer.finish(work)


@pytest.fixture
def tok():
    return _chat_tokenizer(HERMES)


def test_an_openai_sdk_agent_with_tool_calls_trains_exactly_the_sampled_tokens(tok, tmp_path):
    rollout = Scripted(tok, _calculator_policy)
    producer = _producer(tok, f"{AGENTS}:calculator_agent", tmp_path)
    try:
        metas = [_meta("q1", question="What is 2+3?", answer="5"), _meta("q2", question="And 2+3?", answer="5")]
        work, out = _run(producer, rollout, metas, [11, 12])
    finally:
        producer.close()
    assert out.scores.tolist() == [1.0, 1.0]  # the final answers, scored by reward.function
    assert out.metrics["agent/sessions"] == 2 and out.metrics["agent/calls_mean"] == 2 and out.metrics["agent/failures"] == 0
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, run in zip(range(2), work.runs, strict=True):
        ids, mask = out.batch["input_ids"][row], out.batch["loss_mask"][row]
        drawn = [t for s in run.session.record for t in s.token_ids.tolist()]
        assert ids[mask > 0].tolist() == drawn  # the sampled ids, in order, nothing else
        assert tok.decode(drawn) == f"{CALL}<|im_end|>{metas[row].columns['question'][0]}: \\boxed{{5}}<|im_end|>"
        text = tok.decode(ids.tolist())
        assert "<|im_start|>tool\n5<|im_end|>" in text and text.startswith("<|im_start|>system\nUse the calculator")
        assert drawn.count(end) == 2
    # The per-turn parity metric's turn index: each call's tokens carry their call.
    assert sorted(set(out.turns[out.batch["loss_mask"].values() > 0].tolist())) == [0, 1]


def test_a_tokenizer_that_does_not_round_trip_still_trains_the_sampled_split(tmp_path):
    """The sampled tokens are a non-canonical split ('a','b' where the vocabulary has 'ab'):
    re-encoding the text would train other ids; the gateway keeps the draw."""
    from tests.agents.scripted import _bpe_tokenizer

    tok = _bpe_tokenizer()
    rollout = Scripted(tok, lambda prompt: "abab", split_pieces=True)
    producer = _producer(tok, f"{AGENTS}:two_turns", tmp_path, reward=False)
    try:
        work, out = _run(producer, rollout, [_meta("ab")], [3])
    finally:
        producer.close()
    a, b, end = (tok.convert_tokens_to_ids(x) for x in ("a", "b", "<|im_end|>"))
    mask = out.batch["loss_mask"][0]
    assert out.batch["input_ids"][0][mask > 0].tolist() == [a, b, a, b, end] * 2


def test_a_rewritten_history_is_refused_or_split(tok, tmp_path):
    rollout = Scripted(tok, lambda prompt: "ok")
    producer = _producer(tok, f"{AGENTS}:rewrites_history", tmp_path, reward=False)
    try:
        _, out = _run(producer, rollout, [_meta("x")], [1])
        assert out.scores.tolist() == [1.0]  # the agent saw the 400 naming the mismatch and reported it
    finally:
        producer.close()
    producer = _producer(tok, f"{AGENTS}:rewrites_history", tmp_path, reward=False, history_mismatch="split")
    try:
        _, out = _run(producer, rollout, [_meta("x")], [1])
    finally:
        producer.close()
    assert out.scores.tolist() == [2.0] and len(out.batch["input_ids"]) == 2 and out.metrics["env/split_frac"] == 1


@pytest.mark.parametrize("on_failure, kept", [("drop_group", 2), ("drop_session", 3)])
def test_failing_agents_are_counted_and_dropped_never_scored_zero(tok, tmp_path, on_failure, kept):
    """Two groups of two sessions; in the first, one agent raises: its group (or only it) is left
    out; an agent that exits, one that hangs past its time and one that never calls the model
    are failures too."""
    rollout = Scripted(tok, _calculator_policy)
    producer = _producer(tok, f"{AGENTS}:by_row", tmp_path, n=2, timeout_s=10.0, agent={"on_failure": on_failure})
    metas = [
        _meta("a", how="raises", answer="5"),
        _meta("a", how="ok", answer="5"),
        _meta("b", how="ok", answer="5"),
        _meta("b", how="ok", answer="5"),
    ]
    try:
        _, out = _run(producer, rollout, metas, [1, 2, 3, 4])
        assert out.metrics["agent/failures"] == 1 and out.metrics["agent/dropped"] == 4 - kept
        assert len(out.scores) == kept and out.scores.tolist() == [1.0] * kept
        assert out.group_ids(2).tolist() == ([1, 1] if on_failure == "drop_group" else [0, 1, 1])
        metas = [_meta(h, how=h, answer="5") for h in ("exits", "hangs", "no_call", "ok")]
        if on_failure == "drop_group":  # both groups hold a failure: nothing is left to train, said
            with pytest.raises(RuntimeError, match=r"every session of the batch failed \(3 of 4; session 0: its process exited"):
                _run(producer, rollout, metas, [5, 6, 7, 8])
        else:
            _, out = _run(producer, rollout, metas, [5, 6, 7, 8])
            assert (out.metrics["agent/failures"], out.metrics["agent/timeouts"]) == (2, 1)
            assert len(out.scores) == 1
    finally:
        producer.close()
    assert "agent prints this to stderr" in (tmp_path / "logs" / "agents.log").read_text()


def test_bad_requests_get_openai_errors_and_the_session_goes_on(tok, tmp_path):
    rollout = Scripted(tok, _calculator_policy)
    producer = _producer(tok, f"{AGENTS}:probes", tmp_path, agent={"max_body_bytes": 4096})
    try:
        _, out = _run(producer, rollout, [_meta("q", question="2+3?", answer="5")], [1])
        assert out.scores.tolist() == [1.0]  # the session answered correctly after every refusal
        # The batch is scored: its session's state is freed, and a late call is told it ended.
        gateway = producer.gateway
        assert not gateway.sessions and len(gateway.ended) == 1
        (sid,) = gateway.ended
        body = json.dumps({"messages": [{"role": "user", "content": "again"}]}).encode()
        request = urllib.request.Request(f"{gateway.url(sid)}/chat/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=5)
        assert err.value.code == 409 and "has ended" in json.loads(err.value.read())["error"]["message"]
    finally:
        producer.close()
    with pytest.raises(urllib.error.URLError):  # closed with the producer
        urllib.request.urlopen(f"http://{gateway.host}:{gateway.port}/v1/models", timeout=2)


def test_sessions_are_not_guessable_and_a_foreign_session_is_unknown(tok, tmp_path):
    producer = _producer(tok, f"{AGENTS}:two_turns", tmp_path, reward=False)
    try:
        work = producer.start(0, [torch.zeros(1)], [_meta("x")], [1])
        run = producer._open(work, 0)
        assert len(run.session.id) >= 32 and run.base_url.endswith(f"/sessions/{run.session.id}/v1")
        other = run.base_url.replace(run.session.id, run.session.id[:-1] + ("A" if run.session.id[-1] != "A" else "B"))
        request = urllib.request.Request(f"{other}/chat/completions", data=json.dumps({"messages": []}).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=5)
        assert err.value.code == 404 and "no session" in json.loads(err.value.read())["error"]["message"]
        models = json.loads(urllib.request.urlopen(f"{run.base_url}/models", timeout=5).read())
        assert models["data"][0]["id"] == "enginekit-policy"
    finally:
        producer.close()


def test_an_agent_framework_runs_unchanged_against_the_gateway(tok, tmp_path):
    """LangGraph's prebuilt ReAct agent over LangChain's ChatOpenAI (the shipped example,
    unmodified but for base_url): its tool loop goes through the gateway, the trained tokens are
    the sampled ones and its final answer is scored."""
    rollout = Scripted(tok, _calculator_policy)
    producer = _producer(tok, "examples/agents/langgraph_calculator.py:run", tmp_path)
    try:
        metas = [_meta("q", question="What is 2+3?", answer="5")]
        work, out = _run(producer, rollout, metas, [5])
    finally:
        producer.close()
    assert out.scores.tolist() == [1.0] and out.metrics["agent/calls_mean"] == 2
    drawn = [t for s in work.runs[0].session.record for t in s.token_ids.tolist()]
    assert out.batch["input_ids"][0][out.batch["loss_mask"][0] > 0].tolist() == drawn
    assert "<|im_start|>tool\n5<|im_end|>" in tok.decode(out.batch["input_ids"][0].tolist())
