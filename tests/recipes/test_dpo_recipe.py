"""``recipes.dpo`` end to end (issue 64): the demo's pairs, exact resume, LoRA's reference as the
same model with its adapters off, and the user's pair files (text, chat, implicit prompt; bad
rows named). The losses and the step against plain HF at every layout: ``tests/roles/test_preference.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.dpo_demo import build_start
from posttrain.preference_data import PreferenceDataConfig, PreferenceDataset, sort_pairs_at
from posttrain.rewards import sort_task_score
from tests.support import launch
from tests.support.user_data import build_tokenizer, write_rows

ROOT = Path(__file__).resolve().parents[2]
FAST = ["data.batch_size=8", "trainer.progress_bar=false", "trainer.val_every=0", "dpo.sft_weight=0"]


def _dpo(out: Path, steps: int, *extra: str) -> list[dict]:
    args = ["-m", "recipes.dpo", "--config", str(ROOT / "configs" / "dpo_tiny.yaml"), f"trainer.output_dir={out}"]
    proc = launch.run_script([*args, f"trainer.total_steps={steps}", *FAST, *extra], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_demo_resumes_exactly_and_lora_starts_at_its_reference(tmp_path):
    """Steps 4-6 resumed from step 3's checkpoint equal the uninterrupted run's, bit for bit; the
    first step's pair loss is ln 2 exactly where the policy is its reference (a frozen copy, and
    with LoRA the same model with its zero-initialised adapters off), then falls (LoRA: the
    trained adapters give the implicit rewards their first non-zero values). On Ray
    (``trainer.launcher=ray``, the policy and its reference in one worker) the first 3 steps
    equal the in-process run's at float noise (rel 1e-6, as every Ray run here)."""
    start = build_start(str(tmp_path / "start"))  # the demo's starting SFT model, here
    model = (f"engine.model.path={start}", "trainer.setup=null", "engine.optim.total_steps=6")  # one LR schedule for every run
    full = _dpo(tmp_path / "full", 6, *model)
    assert full[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and full[0]["dpo/accuracy"] == 0.0
    assert full[-1]["loss"] < full[0]["loss"]
    _dpo(tmp_path / "cut", 3, *model, "trainer.checkpoint_every=3")
    resumed = _dpo(tmp_path / "cut", 6, *model, "trainer.checkpoint_every=3", "trainer.resume=true")
    untimed = [{k: v for k, v in r.items() if k != "seconds" and not k.endswith("_s")} for r in (*full, *resumed[3:])]
    assert untimed[3:6] == untimed[6:]
    ray = _dpo(tmp_path / "ray", 3, *model, "trainer.launcher=ray", "trainer.placement.cpus_per_worker=0.5")
    for got, want in zip(ray, full[:3], strict=True):
        for key in ("loss", "dpo/rewards_chosen", "dpo/rewards_rejected", "dpo/margin", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (key, got, want)
    assert (tmp_path / "ray" / "hf" / "model.safetensors").exists()  # the export, written by the worker
    lora = _dpo(tmp_path / "lora", 2, *model, "engine.model.lora.rank=4", "engine.optim.lr=1e-2")
    assert lora[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and lora[0]["dpo/rewards_chosen"] == 0.0
    assert lora[1]["dpo/rewards_chosen"] != 0.0 and lora[1]["dpo/rewards_rejected"] != 0.0  # the adapters moved off the reference


def test_every_sort_pair_prefers_the_better_sort():
    """The demo's rejected answer always scores lower under the task's reward than the chosen."""
    from posttrain.data.config import DataConfig

    cfg = DataConfig(batch_size=64, min_digits=2, max_digits=4)
    batch = sort_pairs_at(cfg, 3)
    rows = [(ids.tolist(), mask) for ids, mask in zip(batch["input_ids"].unbind(), batch["loss_mask"].unbind(), strict=True)]
    for (c, cm), (r, rm) in zip(rows[0::2], rows[1::2], strict=True):
        p = int((cm == 0).sum())
        assert c[:p] == r[:p] and int((rm == 0).sum()) == p  # one prompt
        assert sort_task_score(r[p:], c[p:]) < sort_task_score(c[p:], c[p:]) == 1.0


def test_pair_files_in_text_chat_and_implicit_form(tmp_path):
    """TRL's three preference layouts and tinker-cookbook's labeled comparisons load into the same kind of pair (the loss on each side's
    response only); an identical pair is dropped and counted; a missing column, an empty side and
    implicit conversations that differ before the last turn are refused naming the row."""
    tok = build_tokenizer(tmp_path / "tok")
    user = [{"role": "user", "content": "1+2"}]
    rows = [
        {"prompt": "1+2", "chosen": "3", "rejected": "4"},
        {"prompt": user, "chosen": [{"role": "assistant", "content": "3"}], "rejected": [{"role": "assistant", "content": "45"}]},
        {"chosen": [*user, {"role": "assistant", "content": "3"}], "rejected": [*user, {"role": "assistant", "content": "5"}]},
        {"prompt": "1+1", "chosen": "2", "rejected": "2"},
        {  # tinker-cookbook's labeled comparison, B preferred
            "comparison": {
                "prompt_conversation": user,
                "completion_A": [{"role": "assistant", "content": "9"}],
                "completion_B": [{"role": "assistant", "content": "3"}],
            },
            "label": "B",
        },
        {
            "comparison": {
                "prompt_conversation": user,
                "completion_A": [{"role": "assistant", "content": "3"}],
                "completion_B": [{"role": "assistant", "content": "4"}],
            },
            "label": "Tie",
        },
    ]
    ds = PreferenceDataset([write_rows(rows, tmp_path / "pairs.jsonl")], tok, PreferenceDataConfig(max_length=64))
    assert len(ds) == 4 and ds.identical == 1 and ds.ties == 1 and ds.counts.dropped == 2
    for ci, cm, ri, rm in ds.pairs:
        p = cm.index(1)
        assert ci[:p] == ri[:p] and rm.index(1) == p  # the same prompt tokens, the loss after them
        assert tok.decode([t for t, m in zip(ci, cm, strict=True) if m]).startswith("3")
    text, chat, implicit, labeled = ds.pairs
    assert chat[0] == implicit[0] and chat[1] == implicit[1]  # the implicit prompt is the explicit one
    assert labeled[0] == chat[0]  # label B: completion_B ("3") is the chosen side
    batch = ds.batch([0, 1])
    assert batch.batch_size[0] == 4

    bad = {
        "no column 'rejected'": {"prompt": "1+2", "chosen": "3"},
        "is empty": {"prompt": "1+2", "chosen": "3", "rejected": ""},
        "share every message but the last": {
            "chosen": [*user, {"role": "assistant", "content": "3"}],
            "rejected": [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "5"}],
        },
    }
    for i, (message, row) in enumerate(bad.items()):
        path = write_rows([rows[0], row], tmp_path / f"bad{i}.jsonl")
        with pytest.raises(ValueError, match=message) as e:
            PreferenceDataset([path], tok, PreferenceDataConfig(max_length=64))
        assert f"bad{i}.jsonl:2" in str(e.value) and "fix:" in str(e.value)
