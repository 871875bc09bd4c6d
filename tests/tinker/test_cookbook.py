"""tinker-cookbook 0.6.1's ``recipes/sl_loop.py`` and ``recipes/rl_loop.py``, unchanged, against the
Tinker server on the FSDP engine.

What the test supplies, because nothing may be downloaded here: a tiny Llama-style model served
under a name the cookbook knows (``meta-llama/Llama-3.2-1B``: its ``role_colon`` renderer is plain
text), a character tokenizer registered under that name (``tokenizer_utils.register_tokenizer``),
and local rows in place of the hub datasets (``datasets.load_dataset`` patched). The RL loop's
reward needs a ``\\boxed{}`` answer, which an untrained tiny model never writes; its reward
function is replaced by a local rule that scores the sampled text (the share of digits), so the
groups have reward variance and the loop trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest

from posttrain.tiny_model import build_tiny_model
from recipes.tinker_server.config import load_server_config
from recipes.tinker_server.runs import EngineFactory
from tests.support.tinker import KEY, closing_service_clients, running_server

NAME = "meta-llama/Llama-3.2-1B"
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<pad>", "<s>", "</s>"]


def _tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="?")
    hf.save_pretrained(str(path))
    return hf


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(
        model, family="llama", seed=0, vocab_size=len(SPECIALS) + len(CHARS), max_position_embeddings=512, bos_token_id=1, eos_token_id=2
    )
    _tokenizer(model)
    tokenizer_utils.register_tokenizer(NAME, lambda: AutoTokenizer.from_pretrained(str(model)))
    cfg = load_server_config(
        "configs/tinker_tiny.yaml",
        [f"server.aliases=[{NAME}={model}]", f"server.state_dir={tmp_path_factory.mktemp('state')}", "server.max_runs=8"],
    )
    with running_server(cfg.server_settings(), EngineFactory(None, cfg.alias_table(), cfg.run_settings())) as url:
        yield url


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop_trains_and_the_nll_goes_down(server, tmp_path, monkeypatch):
    from tinker_cookbook.recipes import sl_loop

    convo = [{"role": "user", "content": "Say the sequence."}, {"role": "assistant", "content": "abcabcabc 123"}]
    rows = datasets.Dataset.from_list([{"messages": convo} for _ in range(16)])
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict({"train": rows}))
    log = tmp_path / "sl"
    with closing_service_clients():  # the loop never closes its ServiceClient
        sl_loop.main(
            sl_loop.Config(base_url=server, log_path=str(log), model_name=NAME, batch_size=2, learning_rate=0.01, lora_rank=4, save_every=4)
        )
    nll = [m["train_mean_nll"] for m in _metrics(log) if "train_mean_nll" in m]
    assert len(nll) == 8 and all(math.isfinite(x) for x in nll)
    assert nll[-1] < 0.8 * nll[0], nll  # the same conversation every step: the summed cross_entropy must fit it
    assert (log / "checkpoints.jsonl").exists()  # save_every=4 and the final save went through the server


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo"])
def test_rl_loop_samples_scores_and_trains(server, tmp_path, monkeypatch, loss_fn):
    from tinker_cookbook.recipes import rl_loop

    rows = datasets.Dataset.from_list([{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i % 10}"} for i in range(8)])
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict({"train": rows}))
    scored: list[float] = []

    def reward(response: str, answer: str) -> float:
        # the share of digits in the response: ~10% of an untrained character model's output, so
        # (unseeded sampling: rl_loop passes no seed) a group of 4 x 12 tokens has reward variance
        # but for a chance of ~1e-2, and one of the 4 groups is enough for a training step
        value = sum(c.isdigit() for c in response) / max(1, len(response))
        scored.append(value)
        return value

    monkeypatch.setattr(rl_loop, "get_reward", reward)
    log = tmp_path / "rl"
    config = rl_loop.Config(
        base_url=server,
        log_path=str(log),
        model_name=NAME,
        batch_size=2,
        group_size=4,
        max_tokens=12,
        lora_rank=4,
        save_every=0,
        max_steps=2,
    )
    object.__setattr__(config, "loss_fn", loss_fn)  # ppo is a loss of the API; the recipe's type hint lists four of them
    with closing_service_clients():  # the loop never closes its ServiceClient
        rl_loop.main(config)
    metrics = _metrics(log)
    steps = [m for m in metrics if "reward/total" in m]
    assert len(steps) == 2
    assert len(scored) == 2 * 2 * 4  # every sampled sequence was scored
    assert any(s > 0 for s in scored) and any("grad_norm:mean" in m for m in steps)  # variance -> a training step ran
