"""Logged generations (``trainer.log_samples_every``): what is logged is what the model does.

SFT: the logged greedy generations equal plain HF ``generate`` (greedy) of the exported model
at the logging step. RL: each logged reward is the task's score of the logged response (an
off-by-one pairing of responses and rewards fails). Both on the built-in sorting task, whose
token ids are read back from the rendered text (``posttrain.sort_task.render``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain import sort_task as task
from posttrain.rewards import sort_task_score

ROOT = Path(__file__).resolve().parents[2]


def _ids(text: str) -> list[int]:
    """Token ids of ``render``'s text (digits, `` -> ``, ``<bos>``, ``<eos>``, ``<pad>``, ``<N>``)."""
    names = {"<bos>": task.BOS, "<eos>": task.EOS, "<pad>": task.PAD}
    out, i = [], 0
    while i < len(text):
        if text.startswith(" -> ", i):
            out.append(task.SEP)
            i += 4
        elif text[i] == "<":
            end = text.index(">", i) + 1
            tag = text[i:end]
            out.append(names[tag] if tag in names else int(tag[1:-1]))
            i = end
        else:
            out.append(task.FIRST_DIGIT + int(text[i]))
            i += 1
    return out


def test_render_reads_back():
    ids = [task.BOS, 4, 9, 13, task.SEP, 17, task.PAD, task.EOS]
    assert _ids(task.render(ids)) == ids


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sft_samples_are_the_greedy_generations_of_the_trained_model(tmp_path, own_process_group):
    from transformers import AutoModelForCausalLM

    from recipes.sft import main

    out = tmp_path / "run"
    main(
        [
            "--config",
            str(ROOT / "configs" / "sft_tiny.yaml"),
            f"trainer.output_dir={out}",
            "trainer.total_steps=40",
            "trainer.log_samples_every=40",
            "trainer.log_samples=3",
            "trainer.progress_bar=false",
            "trainer.save_hf=true",
            "data.eval_batches=1",
        ]
    )
    rows = _rows(out / "samples.jsonl")
    assert [r["step"] for r in rows] == [40, 40, 40]
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    for row in rows:
        prompt = torch.tensor([_ids(row["prompt"])])
        reference = _ids(row["reference"])
        with torch.no_grad():
            greedy = model.generate(
                prompt, do_sample=False, max_new_tokens=len(reference) + 16, eos_token_id=task.EOS, pad_token_id=task.PAD
            )
        assert _ids(row["response"]) == greedy[0, prompt.shape[1] :].tolist(), row


@pytest.mark.slow
def test_rl_samples_carry_the_reward_of_their_own_response(tmp_path):
    from recipes.ppo import main

    out = tmp_path / "run"
    main(
        [
            "--config",
            str(ROOT / "configs" / "grpo_tiny.yaml"),
            f"trainer.output_dir={out}",
            "trainer.total_steps=2",
            "trainer.log_samples_every=1",
            "trainer.log_samples=6",
            "trainer.progress_bar=false",
            "data.batch_size=4",
            "algo.n_samples=4",
        ]
    )
    rows = _rows(out / "samples.jsonl")
    assert [r["step"] for r in rows] == [1] * 6 + [2] * 6
    for row in rows:
        digits = [i - task.FIRST_DIGIT for i in _ids(row["prompt"]) if task.FIRST_DIGIT <= i < task.FIRST_DIGIT + task.NUM_DIGITS]
        target = [task.FIRST_DIGIT + d for d in sorted(digits)] + [task.EOS]
        assert row["reward"] == pytest.approx(sort_task_score(_ids(row["response"]), target)), row
    # The first response of each of the 4 prompt groups first: 4 different prompts, then group 1 again.
    assert len({r["prompt"] for r in rows[:4]}) == 4 and rows[4]["prompt"] == rows[0]["prompt"]
