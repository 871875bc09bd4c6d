"""A user's model directory and data files, built offline with a fixed seed: a character-level
HF tokenizer (``tokenizers`` WordLevel, saved with a chat template) next to a tiny Llama-style
model, and two-digit additions as chat messages (SFT) and as prompt/answer rows (RL) in every
supported file format. Everything is loaded back through the real paths
(``AutoTokenizer.from_pretrained``, the recipes' file readers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from posttrain.tiny_model import build_tiny_model

SPECIALS = ["<pad>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
CHARS = list("0123456789+=?x ")
# BOS, then per turn: the role marker, the content, the end-of-turn marker (also the EOS);
# the generation prompt is the assistant marker.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REWARD_FILE = '''"""A user's reward file: partial credit for the answer's digits, and a log of every call."""
import json, os


def score(prompt, response, answer, **columns):
    want = str(answer)
    hits = sum(1 for i, c in enumerate(want) if i < len(response) and response[i] == c)
    log = os.environ.get("REWARD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"prompt": prompt, "response": response, "answer": answer, "columns": sorted(columns)}) + "\\n")
    return hits / len(want) - 0.1 * max(0, len(response) - len(want))
'''


def build_tokenizer(path: str | Path, chat_template: bool = True):
    """Save a character-level tokenizer (EOS = ``<|end|>``) to ``path``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token="?",
        chat_template=TEMPLATE if chat_template else None,
    )
    hf.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    hf.save_pretrained(str(path))
    return hf


def build_model_dir(
    path: str | Path, family: str = "llama", chat_template: bool = True, tokenizer: bool = True, seed: int = 0, head_dim: int | None = None
) -> str:
    """A tiny HF model directory with (optionally) its tokenizer; ``head_dim=32`` for vLLM on CPU."""
    vocab = len(SPECIALS) + len(CHARS)
    build_tiny_model(
        path,
        family=family,
        seed=seed,
        vocab_size=vocab,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        head_dim=head_dim,
    )
    if tokenizer:
        build_tokenizer(path, chat_template)
    return str(path)


def additions(n: int, seed: int, max_operand: int = 9) -> list[tuple[str, str]]:
    """``n`` (question, answer) pairs such as ``("3+4=", "7")``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append((f"{a}+{b}=", str(a + b)))
    return out


def message_rows(n: int, seed: int) -> list[dict]:
    """SFT rows in the ``messages`` format: one turn, or (every third row) a system turn and
    two user/assistant turns."""
    pairs = additions(2 * n, seed)
    rows = []
    for i in range(n):
        (q1, a1), (q2, a2) = pairs[2 * i], pairs[2 * i + 1]
        if i % 3 == 2:
            msgs = [
                {"role": "system", "content": "x", "name": "sys"},  # a key other messages lack
                {"role": "user", "content": q1},
                {"role": "assistant", "content": a1},
                {"role": "user", "content": q2},
                {"role": "assistant", "content": a2},
            ]
        else:
            msgs = [{"role": "user", "content": q1}, {"role": "assistant", "content": a1}]
        rows.append({"messages": msgs, "id": i})
    return rows


def prompt_rows(n: int, seed: int) -> list[dict]:
    """RL rows: a prompt, the answer (an int, as math datasets often store it) and an id."""
    return [{"prompt": q, "answer": int(a), "id": i} for i, (q, a) in enumerate(additions(n, seed))]


def write_rows(rows: list[dict], path: str | Path) -> str:
    """``rows`` as ``.jsonl``, ``.json`` (an array) or ``.parquet`` (by the extension)."""
    path = str(path)
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.endswith(".jsonl"):
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        Path(path).write_text(json.dumps(rows))
    return path


def write_reward_file(path: str | Path) -> str:
    Path(path).write_text(REWARD_FILE)
    return str(path)
