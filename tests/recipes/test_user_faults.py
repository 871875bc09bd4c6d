"""Faults in the user's own code and data (issue 28): a reward function that exits, raises a
``BaseException`` or hangs stops the run on every rank, promptly and non-zero, naming it;
message content that is not text, runaway JSON lines, a directory without data files, and
``data.*_files`` given as one string or a glob pattern. Model and files are built locally
(``tests/support/user_data.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_api.typed_config import load_typed
from posttrain import rewards
from posttrain.text_data import DataConfig, PromptDataset, SFTDataset, load_tokenizer, read_rows
from recipes.ppo import PPOConfig
from recipes.sft import SFTConfig
from tests.support import launch
from tests.support import user_data as ud

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("faults")
    return {
        "dir": str(d),
        "model": ud.build_model_dir(d / "model"),
        "rl": ud.write_rows(ud.prompt_rows(8, 2), d / "rl.jsonl"),
        "sft": ud.write_rows(ud.message_rows(4, 0), d / "sft.jsonl"),
    }


# ---------------------------------------------------------------------------------- rewards
COLS, SRCS = [{"answer": 1}, {"answer": 2}], ["f.jsonl:1", "f.jsonl:2"]


def _score(fn, batched=False, timeout_s=None):
    return rewards.compute_rewards(fn, batched, ["p", "p"], ["r", "r"], COLS, SRCS, name="rw.py:score", timeout_s=timeout_s)


@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_base_exceptions_from_a_reward_function_become_errors_naming_it(timeout_s):
    def exits(p, r, answer):
        sys.exit(0)

    def gen_exit(p, r, answer):
        raise GeneratorExit

    for fn, what in ((exits, r"SystemExit\(0\).*sys\.exit"), (gen_exit, "GeneratorExit")):
        with pytest.raises(rewards.RewardError, match=rf"reward.function = 'rw.py:score' on row f\.jsonl:1 .*{what}"):
            _score(fn, timeout_s=timeout_s)

    def interrupted(p, r, answer):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # an interrupt stays an interrupt
        _score(interrupted, timeout_s=timeout_s)


def test_a_reward_call_past_the_timeout_names_the_function_and_the_limit():
    def slow(p, r, answer):
        time.sleep(answer * 1.5)  # row 2 runs past the limit
        return 1.0

    t0 = time.perf_counter()
    with pytest.raises(rewards.RewardError, match=r"'rw.py:score' on row f\.jsonl:2 .*did not return within reward.timeout_s = 2 s"):
        _score(slow, timeout_s=2)
    assert time.perf_counter() - t0 < 8

    # batched: the limit covers the whole call, including a generator's lazily run body
    def lazy(ps, rs, answer):
        for a in answer:
            time.sleep(5)
            yield float(a)

    with pytest.raises(rewards.RewardError, match=r"\(batched\) on the rows f\.jsonl:1 \.\. f\.jsonl:2: did not return within"):
        _score(lazy, batched=True, timeout_s=1)
    assert _score(lambda ps, rs, answer: (float(a) for a in answer), batched=True, timeout_s=5).tolist() == [1.0, 2.0]


def test_reward_timeout_config():
    assert rewards.RewardConfig().timeout_s == rewards.DEFAULT_TIMEOUT_S
    with pytest.raises(ValueError, match=r"reward.timeout_s = 0.0: must be positive"):
        load_typed(PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", ["reward.timeout_s=0"])
    assert load_typed(PPOConfig, ROOT / "configs" / "grpo_tiny.yaml", ["reward.timeout_s=null"]).reward.timeout_s is None


EXITING = """import sys


def score(prompt, response, answer, **columns):
    sys.exit(0)
"""
HANGING = """import time


def score(prompt, response, answer, **columns):
    time.sleep(3600)
    return 0.0
"""


def _grpo(files, out: Path, reward: str, nproc: int, *extra: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    args = [
        "-m",
        "recipes.ppo",
        "--config",
        str(ROOT / "configs" / "grpo_tiny.yaml"),
        f"engine.model.path={files['model']}",
        f"data.train_files={files['rl']}",  # one string, no brackets (item 5)
        f"reward.function={reward}",
        "data.batch_size=2",
        "algo.n_samples=2",
        "data.max_response_length=2",
        "trainer.total_steps=1",
        f"trainer.output_dir={out}",
        "trainer.progress_bar=false",
        # far below the default: a rank left waiting would fail only after this
        "engine.dist_timeout_s=120",
        *extra,
    ]
    t0 = time.perf_counter()
    proc = launch.run_script(args, nproc=nproc, timeout=timeout)
    return proc, time.perf_counter() - t0


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_reward_function_calling_sys_exit_stops_every_rank_promptly(files, tmp_path, nproc):
    """Before: 1 rank exited 0 having trained nothing, silently; 2 ranks printed only gloo
    timeouts. Now: a non-zero exit naming the function on every rank, well inside the 120 s
    collective timeout (the ranks agree through the step's collective)."""
    reward = Path(files["dir"]) / "rw_exit.py"
    reward.write_text(EXITING)
    proc, took = _grpo(files, tmp_path / "run", f"{reward}:score", nproc)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rw_exit.py:score" in out and "SystemExit(0)" in out, out[-3000:]
    if nproc == 2:  # the other rank stops on rank 0's failure, naming the function too
        assert "failed on rank 0" in out, out[-3000:]
    assert took < 110, took
    assert "Timed out" not in out and "timeout" not in out.lower().replace("timeout_s", ""), out[-3000:]


def test_a_hanging_reward_function_stops_the_run_at_its_timeout(files, tmp_path):
    reward = Path(files["dir"]) / "rw_hang.py"
    reward.write_text(HANGING)
    proc, took = _grpo(files, tmp_path / "run", f"{reward}:score", 1, "reward.timeout_s=2", timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rw_hang.py:score" in out and "did not return within reward.timeout_s = 2 s" in out, out[-3000:]
    assert took < 100, took


# ---------------------------------------------------------------------------------- message content
@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, r"message 1 \(assistant\) has content null"),
        (7, r"message 1 \(assistant\): content is a int \(7\), not text"),
        ({"text": "7"}, r"message 1 \(assistant\): content is a dict"),
        ([{"type": "image_url", "image_url": {"url": "x"}}], r"message 1 \(assistant\): its content is a list of parts .*'image_url'"),
    ],
)
def test_sft_messages_with_non_text_content_are_refused(files, tmp_path, content, match):
    bad = tmp_path / "bad.jsonl"
    rows = [{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}]
    rows.append({"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": content}]})
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"row .*bad\.jsonl:2: {match}"):
        SFTDataset([str(bad)], load_tokenizer(files["model"]), DataConfig())


def test_text_parts_are_joined_and_rl_prompts_follow_the_same_rule(files, tmp_path):
    tok = load_tokenizer(files["model"])
    parts = [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]
    rows = [
        {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "3"}]},
        {"messages": [{"role": "user", "content": "1+\n2="}, {"role": "assistant", "content": "3"}]},
    ]
    got = SFTDataset([ud.write_rows(rows, tmp_path / "parts.jsonl")], tok, DataConfig()).samples
    assert got[0] == got[1]
    bad = ud.write_rows([{"prompt": [{"role": "user", "content": None}], "answer": 1}], tmp_path / "rl_bad.jsonl")
    with pytest.raises(ValueError, match=r"rl_bad\.jsonl:1: message 0 \(user\) has content null"):
        PromptDataset([bad], tok, DataConfig())


# ---------------------------------------------------------------------------------- files
def test_a_runaway_json_line_is_refused_before_parsing(files, tmp_path):
    """A line over data.max_row_bytes is refused naming file, line, size and limit, without
    parsing it (the line is not even valid JSON here: a parse would fail differently)."""
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "' + "x" * 5000 + "\n")
    with pytest.raises(ValueError, match=r"row .*big\.jsonl:2 is 5013 bytes, over data.max_row_bytes = 4096"):
        read_rows([str(path)], max_row_bytes=4096)
    # the default limit, through the dataset: 9 MiB of valid JSON on one line
    path.write_text(json.dumps({"prompt": "x" * (9 * 2**20), "answer": 1}) + "\n")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"big\.jsonl:1 is \d+ bytes, over data.max_row_bytes = 8388608"):
        PromptDataset([str(path)], load_tokenizer(files["model"]), DataConfig())
    assert time.perf_counter() - t0 < 5
    # .json arrays and Parquet: the row's text, measured after reading, before tokenizing
    arr = ud.write_rows([{"prompt": "x" * 5000, "answer": 1}], tmp_path / "big.parquet")
    with pytest.raises(ValueError, match=r"big\.parquet\[0\] is about \d+ bytes of text, over data.max_row_bytes = 4096"):
        read_rows([arr], max_row_bytes=4096)


def test_a_directory_without_data_files_is_reported_not_missing(tmp_path):
    """A directory is a source (its data files, posttrain.text_data); one holding none is named
    as such, never reported as a missing file."""
    empty = tmp_path / "empty"
    empty.mkdir()
    problems = str(_load_error([f"data.train_files=[{empty}]"]))
    assert f"the directory {str(empty)!r} holds no data file" in problems and "does not exist" not in problems
    with pytest.raises(ValueError, match="holds no data file"):
        read_rows([str(empty)])


def test_data_files_take_one_string_or_a_glob(files, tmp_path):
    for i in (2, 0, 1):
        ud.write_rows(ud.message_rows(2, i), tmp_path / f"part-{i}.jsonl")
    model = f"engine.model.path={files['model']}"
    cfg = _load([model, f"data.train_files={tmp_path / 'part-0.jsonl'}", f"data.val_files={tmp_path}/part-*.jsonl"])
    assert cfg.data.train_files == [str(tmp_path / "part-0.jsonl")]
    assert cfg.data.val_files == [str(tmp_path / f"part-{i}.jsonl") for i in range(3)]  # sorted
    both = _load([model, f"data.train_files=[{tmp_path / 'part-2.jsonl'},'{tmp_path}/part-[01].jsonl']"]).data.train_files
    assert both == [str(tmp_path / f"part-{i}.jsonl") for i in (2, 0, 1)]
    problems = str(_load_error([f"data.train_files={tmp_path}/nothing-*.jsonl"]))
    assert f"the pattern '{tmp_path}/nothing-*.jsonl' matches no file" in problems


def _load(overrides: list[str]) -> SFTConfig:
    return load_typed(SFTConfig, ROOT / "configs" / "sft_tiny.yaml", overrides)


def _load_error(overrides: list[str]) -> ValueError:
    with pytest.raises(ValueError) as err:
        _load(overrides)
    return err.value
