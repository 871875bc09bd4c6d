"""The multi-turn demo (``configs/agent_tiny.yaml``): a tiny model, built here, learns to call a
tool before it answers, because the answer is only in the tool's result.

Each row asks for the value stored under a key (``key 37``); the value is a random digit drawn
per row, so no model can know it without asking. :class:`LookupEnv` answers a turn that
contains ``<tool_call>`` with the row's value (a ``tool`` message) and scores the first turn
without one as the final answer: 0.8 when it is the value (the digits of a longer value scored
in place), plus 0.2 when the lookup was made first. An untrained model scores ~0.04 (it rarely
calls, and guesses); one that learned to call and copy scores 1.

The assets (written once into ``--assets``, default ``outputs/agent_tiny/assets``): a tiny
Llama-style model with a character-level tokenizer whose chat template is ChatML (Qwen's
turn markup, with ``<tool_call>`` / ``</tool_call>`` as single tokens like Qwen's), and
``train.jsonl`` / ``val.jsonl``. The environment reads the row's ``value`` column.

Run: ``python -m recipes.agent_demo [key=value ...]`` (builds the assets with
:func:`build_assets`, then runs ``python -m recipes.ppo --config configs/agent_tiny.yaml`` with
the overrides).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from posttrain.agents.env import StepResult, Turn

DEFAULT_ASSETS = "outputs/agent_tiny/assets"
MARKER = "enginekit_agent_demo.json"  # in the model directory: the recipe's demo-settings warnings stay quiet
SPECIALS = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>"]
# Single non-special tokens: the tool-call tags (as in Qwen's tokenizer) and the chat roles (so a
# role name is one token). With the digits and the prompt's few letters, 24 tokens in all: a
# random policy writes a digit often enough for the reward to find the copy.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
WORDS = ["user", "assistant", "tool"]
CHARS = list("0123456789key :\n")
# ChatML, as Qwen writes it (tools are not listed in the demo's system text: its one tool is
# called by the bare <tool_call> token, which LookupEnv understands).
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class LookupEnv:
    """The demo's environment (module docstring). ``value``: the row's column."""

    def __init__(self, prompt: str, value: str, **columns) -> None:
        self.value, self.called = str(value), False

    def step(self, turn: Turn) -> StepResult:
        if "<tool_call>" in turn.text:
            self.called = True
            return StepResult({"role": "tool", "content": self.value}, 0.0, False)
        answer = turn.text.strip()
        right = sum(a == b for a, b in zip(answer, self.value, strict=False)) / len(self.value)
        return StepResult(None, 0.8 * right + 0.2 * self.called, True)


def character_tokenizer():
    """One token per character of :data:`CHARS`, ChatML specials, and the tool-call tags and
    role names as single non-special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + TOOL_TOKENS + WORDS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>", unk_token="<pad>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "</s>"]})
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS + WORDS])
    fast.chat_template = TEMPLATE
    return fast


def build_assets(root: str | os.PathLike = DEFAULT_ASSETS, rows: int = 256, seed: int = 0, family: str = "llama") -> str:
    """The model directory and data files under ``root`` (kept when present); returns ``root``.
    ``family``: the tiny model's (``posttrain.tiny_model``; e.g. ``qwen3_moe`` for routing replay)."""
    from posttrain.tiny_model import build_tiny_model

    root = Path(root)
    model = root / "model"
    if not (model / "tokenizer.json").exists():
        tok = character_tokenizer()
        # head_dim 32: vLLM's CPU attention refuses narrower heads (rollout.backend=vllm runs it too).
        build_tiny_model(
            model, family=family, seed=seed, vocab_size=len(tok), max_position_embeddings=128, eos_token_id=tok.eos_token_id, head_dim=32
        )
        tok.save_pretrained(str(model))
        (model / MARKER).write_text(json.dumps({"built_by": "posttrain.agents.demo", "seed": seed, "family": family}) + "\n")
    rng = random.Random(seed)
    for name, count in (("train.jsonl", rows), ("val.jsonl", 32)):
        path = root / name
        if path.exists():
            continue
        with open(path, "w") as f:
            for _ in range(count):
                key, value = f"{rng.randrange(100):02d}", str(rng.randrange(10))
                f.write(json.dumps({"prompt": f"key {key}", "value": value}) + "\n")
    return str(root)


def build_default_assets() -> str:
    """:func:`build_assets` into :data:`DEFAULT_ASSETS` (what ``configs/agent_tiny.yaml`` and
    ``configs/agent_gateway_tiny.yaml`` point at; their ``trainer.setup``)."""
    return build_assets(DEFAULT_ASSETS)


def is_demo_model(path: str | os.PathLike | None) -> bool:
    """Whether ``path`` is the demo's model directory (built by :func:`build_assets`): a
    freshly initialised tiny model, for which the demo config's settings are right."""
    return path is not None and (Path(path) / MARKER).is_file()
