"""The scripted policy, tokenizers, templates and loop builders the agent tests share (a test
module never imports another: ``tests/support/test_no_test_imports.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine_api.rollout import Sample
from posttrain.agents import AgentLoop, EnvConfig
from posttrain.agents.demo import TEMPLATE
from posttrain.text_data import PromptSample

HERMES = TEMPLATE.replace("{% for m in messages %}", "{% for m in messages %}{# <tool_call> #}")
# Like Qwen3's: an assistant turn before the last message is written without its reasoning.
STRIPS_REASONING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class Scripted:
    """The rollout role's ``sample``: each prompt answered by ``policy(prompt_text)`` (text,
    tokenized piece by piece as ``pieces`` says), with made-up log-probs; records every call."""

    def __init__(self, tok, policy, split_pieces: bool = False, stop: str = "<|im_end|>") -> None:
        self.tok, self.policy, self.split, self.stop = tok, policy, split_pieces, stop
        self.calls: list[list[list[int]]] = []

    def sample(self, prompts, seeds, kept=None, max_new_tokens=None, stop=()):
        out, drawn = [], []
        for p in prompts:
            text = self.policy(self.tok.decode(p.tolist(), skip_special_tokens=False))
            if self.split:  # one token per character: a non-canonical split for a BPE tokenizer
                ids = [i for ch in text for i in self.tok(ch, add_special_tokens=False)["input_ids"]]
            else:
                ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            ids.append(self.tok.convert_tokens_to_ids(self.stop))
            finish = "stop"
            if max_new_tokens is not None and len(ids) > max_new_tokens:
                ids, finish = ids[:max_new_tokens], "length"
            drawn.append(ids)
            out.append(Sample(torch.tensor(ids), -0.5 - torch.arange(len(ids), dtype=torch.float32) / 100, finish, 1))
        self.calls.append(drawn)
        return out


def _chat_tokenizer(template: str, *extra: str):
    """One token per printable ASCII character, ChatML's specials, and ``extra`` tags as single
    non-special tokens (Qwen's ``<tool_call>`` kind)."""
    from tokenizers import AddedToken

    from tinker_server.demo import character_tokenizer as ascii_tokenizer

    tok = ascii_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>", *extra)])
    tok.chat_template = template
    return tok


def _loop(tok, stop: str = "<|im_end|>", **env) -> AgentLoop:
    settings = {"function": "tools", "max_turns": 3, "max_tokens": 256, **env}
    return AgentLoop(EnvConfig(**settings), tok, {}, [tok.convert_tokens_to_ids(stop)], 1.0, None)


def _meta(prompt: str, **columns) -> PromptSample:
    return PromptSample(torch.zeros(1, dtype=torch.long), prompt, columns, f"test.jsonl:{prompt}", ({"role": "user", "content": prompt},))


def _sampled_in_rows(out, rollout: Scripted) -> None:
    """Every sampled token is in the batch, in order, exactly where the mask is 1."""
    drawn = [t for call in rollout.calls for ids in call for t in ids]
    ids, mask = out.batch["input_ids"].values(), out.batch["loss_mask"].values()
    assert sorted(ids[mask > 0].tolist()) == sorted(drawn)  # the multiset: calls interleave trajectories
    assert int(mask.sum()) == len(drawn)


class Raises:
    def __init__(self, prompt, **columns):
        pass

    def step(self, turn):
        raise KeyError("boom")


def _bpe_tokenizer():
    """A byte-free BPE whose vocabulary has both 'a', 'b' and the merge 'ab': sampling 'a' then
    'b' is a valid draw that re-encodes to one token (decode-then-encode is not the identity)."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast

    chars = list("abcdefghijklmnopqrstuvwxyz0123456789 :\n{}\"',<>/_")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"], initial_alphabet=chars)
    tok.train_from_iterator(["abab ab abc " * 50, "user assistant tool " * 20], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    fast.chat_template = TEMPLATE
    assert fast("ab", add_special_tokens=False)["input_ids"] != [fast.convert_tokens_to_ids(c) for c in "ab"]
    return fast


def demo_args(config: str, assets: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """``python -m recipes.ppo`` on ``configs/<config>`` with the demo's assets at ``assets``
    (``posttrain.agents.demo.build_assets``), writing to ``out``, metrics only."""
    root = Path(__file__).resolve().parents[2]
    return [
        "-m",
        "recipes.ppo",
        "--config",
        str(root / "configs" / config),
        f"engine.model.path={assets / 'model'}",
        f"data.train_files=[{assets / 'train.jsonl'}]",
        f"data.val_files=[{assets / 'val.jsonl'}]",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={steps}",
        "trainer.progress_bar=false",
        "trainer.loggers=[jsonl]",
        *extra,
    ]


def metric_rows(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    """The complete JSON lines of ``out/name`` (none when it does not exist yet)."""
    path = out / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
