"""Generate responses from an HF model directory (a base model or a run's ``hf/`` export) or from an
actor checkpoint, with an RL config's rollout settings; no training, no reward.

Run: ``python -m recipes.generate --config CONFIG generate.prompts='["2+3="]' [key=value ...]`` or
``generate.prompt_file=prompts.jsonl`` (any data file format, the prompt under ``data.prompt_key``),
with ``eval.checkpoint=OUT/checkpoints/actor`` for a checkpoint (``recipes.evaluate``: the same
weights rules). Prompts are encoded as training prompts are (``data.apply_chat_template``, the
model directory's tokenizer and chat template); ``generate.samples_per_prompt`` responses each,
sampled with the ``rollout`` settings (temperature, top-p/k, ``max_new_tokens``, stop strings) from
seeds fixed by ``rollout.seed`` and ``generate.seed``. Rank 0 prints every response and writes them
as JSON lines to ``<trainer.output_dir>/<generate.output_file>``.

Assumptions: ``engine.model.path`` is a model directory with a tokenizer (the built tiny model of
the sorting task has none); the data files and the reward of the config are not read (a run's
config works unchanged, and so does one without ``data.train_files``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.dist import rank
from posttrain.text_data import PromptDataset, load_tokenizer, stop_token_ids
from posttrain.trainer_utils import quiet_console, run_cli
from recipes.evaluate import EvalConfig, launch, load_policy


@dataclass(frozen=True)
class GenerateSection:
    """What to generate.

    Attributes:
        prompts: prompt texts (encoded as training prompts are).
        prompt_file: a data file of prompts (``data.prompt_key`` column), instead of or after ``prompts``.
        samples_per_prompt: responses per prompt.
        seed: the sampling call's seed offset (with ``rollout.seed``: the same seeds, the same responses).
        output_file: the responses, one JSON line each, under ``trainer.output_dir``.
    """

    prompts: list[str] = field(default_factory=list)
    prompt_file: str | None = None
    samples_per_prompt: int = 1
    seed: int = 0
    output_file: str = "generations.jsonl"

    def _problems(self) -> list[str]:
        out = []
        if not self.prompts and self.prompt_file is None:
            out.append(
                "prompts = [] and prompt_file = null: nothing to generate from; fix: generate.prompts='[\"2+3=\"]' or generate.prompt_file=F"
            )
        if self.prompt_file is not None and not os.path.exists(self.prompt_file):
            out.append(f"prompt_file = {self.prompt_file!r}: no such file; fix: a .jsonl / .json / .parquet file of prompts")
        if self.samples_per_prompt < 1:
            out.append(f"samples_per_prompt = {self.samples_per_prompt}: must be >= 1; fix: e.g. 1 or 4")
        if not self.output_file or os.sep in self.output_file:
            out.append(
                f"output_file = {self.output_file!r}: must be a file name (it goes under trainer.output_dir); fix: e.g. generations.jsonl"
            )
        return out


@dataclass(frozen=True)
class GenerateConfig(EvalConfig):
    """``recipes.evaluate``'s config (the run's config + ``eval``) plus the ``generate`` section;
    ``eval.checkpoint`` selects a checkpoint, the other ``eval`` keys are not used."""

    generate: GenerateSection = field(default_factory=GenerateSection)

    def _problems(self) -> list[str]:
        # The prompts come from ``generate``: no validation files needed.
        out = [p for p in super()._problems() if not p.startswith("data.val_files")]
        if self.engine.model.path is None:
            out.append(
                "engine.model.path = None: generation encodes text with the model directory's tokenizer and chat template, and "
                "the built tiny model of the sorting task has none; fix: engine.model.path=DIR (an HF directory with a tokenizer)"
            )
        return out


@dataclass(frozen=True)
class TextSource:
    """What the rollout role needs from a task (``posttrain.tasks``): the tokenizer (stop
    strings) and the ids that end a response."""

    tokenizer: Any
    stop_ids: list[int]


def encode_prompts(cfg: GenerateConfig, tokenizer) -> tuple[list[torch.Tensor], list[str]]:
    """The token ids and texts of ``generate.prompts`` then ``generate.prompt_file``'s rows,
    encoded by the training prompts' rules (``posttrain.text_data.PromptDataset``)."""
    g, d = cfg.generate, cfg.data
    ids, texts = [], []
    if g.prompts:
        with tempfile.TemporaryDirectory(prefix="ek_generate_") as tmp:
            path = os.path.join(tmp, "prompts.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps({d.prompt_key: p}) + "\n" for p in g.prompts)
            inline = PromptDataset([path], tokenizer, d, "generate.prompts")
        ids += [s.ids for s in inline.samples]
        texts += [s.text for s in inline.samples]
    if g.prompt_file is not None:
        rows = PromptDataset([g.prompt_file], tokenizer, d, "generate.prompt_file")
        ids += [s.ids for s in rows.samples]
        texts += [s.text for s in rows.samples]
    return ids, texts


def run(cfg: GenerateConfig) -> list[dict[str, Any]]:
    """Load the weights, sample, write and print the responses; return them as rows."""
    path = cfg.engine.model.path
    tokenizer = load_tokenizer(path)
    source = TextSource(tokenizer, stop_token_ids(tokenizer, path, end_of_turn=cfg.data.apply_chat_template))
    prompts, texts = encode_prompts(cfg, tokenizer)
    n = cfg.generate.samples_per_prompt
    rollout, _, step = load_policy(cfg, cfg.eval.checkpoint, source)
    try:
        batch = rollout.generate([p for p in prompts for _ in range(n)], seed_offset=cfg.generate.seed)
    finally:
        rollout.engine.shutdown()
    ids, offsets = batch["input_ids"].values(), batch["input_ids"].offsets().tolist()
    rows = []
    for i, plen in enumerate(batch["prompt_len"].tolist()):
        response = ids[offsets[i] + plen : offsets[i + 1]].tolist()
        rows.append(
            {
                "prompt": texts[i // n],
                "sample": i % n,
                "response": source.tokenizer.decode(response, skip_special_tokens=True),
                "tokens": len(response),
                "stopped": "length" if int(batch["rollout_truncated"][i]) else "stop",
            }
        )
    if rank() == 0:
        os.makedirs(cfg.trainer.output_dir, exist_ok=True)
        path = os.path.join(cfg.trainer.output_dir, cfg.generate.output_file)
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for r in rows:
            print(f"{r['prompt']!r} -> {r['response']!r} ({r['stopped']}, {r['tokens']} tokens)")
        weights = cfg.eval.checkpoint or cfg.engine.model.path
        print(f"{len(rows)} responses from {weights}{f' (step {step})' if step is not None else ''} in {path}")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Parse ``--config`` + overrides, generate, return the rows."""
    return launch(argv, "python -m recipes.generate", __doc__, GenerateConfig, run)


if __name__ == "__main__":
    quiet_console()
    run_cli(main)
