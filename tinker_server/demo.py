"""An offline first success with the Tinker server: a tiny model served, and tinker-cookbook's
``sl_loop`` / ``rl_loop`` run against it, with nothing downloaded.

    python -m tinker_server.demo serve                    # terminal 1: builds the model once, serves it
    python -m tinker_server.demo sl_loop                  # terminal 2: the cookbook's SFT loop
    python -m tinker_server.demo rl_loop                  # ... or its RL loop

What the demo supplies, because the cookbook loops expect hub assets: a tiny Llama-style model
(built from a config with a fixed seed) with a character-level tokenizer, served under a model
name the cookbook knows (:data:`NAME`, ``meta-llama/Llama-3.2-1B``: its ``role_colon`` renderer
is plain text); that tokenizer registered under the name in the client
(``tinker_cookbook.tokenizer_utils.register_tokenizer``); local rows in place of the hub datasets
(``datasets.load_dataset`` answered with them while the loop runs); and, for ``rl_loop``, a local
reward (the share of digits in the response: an untrained tiny model never writes the
``\\boxed{}`` answer the loop's GSM8K reward wants, so every group would score 0 and nothing
would train). Everything else is the cookbook's own code, unchanged; ``rl_loop`` runs with
``loss_fn=importance_sampling`` (its default, ``stable_reinforce``, needs server-side records the
server does not keep: refused, docs/tinker.md). The loops never close their ``ServiceClient``;
the demo closes every client built while a loop runs, so its session ends with it.

Needs the ``cookbook`` extra (``tinker`` SDK and tinker-cookbook; ``make test`` installs it).
``tests/tinker/test_cookbook.py`` runs the same loops through the same helpers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

NAME = "meta-llama/Llama-3.2-1B"
KEY = "tml-local"  # the SDK wants a key starting with tml-; the demo server accepts any
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
SPECIALS = ["<pad>", "<s>", "</s>"]
DEFAULT_DIR = "outputs/tinker_demo"
DEFAULT_URL = "http://127.0.0.1:8000"


def build_demo_model(root: str | os.PathLike) -> str:
    """The demo's model directory under ``root`` (built once; an existing one is reused): a tiny
    Llama-style HF model whose vocabulary is :func:`character_tokenizer`'s."""
    from posttrain.tiny_model import build_tiny_model

    path = Path(root) / "model"
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        vocab = len(SPECIALS) + len(CHARS)
        build_tiny_model(path, family="llama", seed=0, vocab_size=vocab, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
        character_tokenizer().save_pretrained(str(path))
    return str(path)


def character_tokenizer():
    """One token per printable ASCII character (plus newline), with pad / bos / eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="?")


def register_tokenizer(model_dir: str) -> None:
    """Make the cookbook resolve :data:`NAME`'s tokenizer to the demo model's (no download)."""
    from tinker_cookbook import tokenizer_utils
    from transformers import AutoTokenizer

    tokenizer_utils.register_tokenizer(NAME, lambda: AutoTokenizer.from_pretrained(model_dir))


@contextlib.contextmanager
def local_dataset(rows: list[dict]) -> Iterator[None]:
    """``datasets.load_dataset`` answers ``rows`` (as the ``train`` split) inside the block."""
    import datasets

    real = datasets.load_dataset
    datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
    try:
        yield
    finally:
        datasets.load_dataset = real


@contextlib.contextmanager
def closing_service_clients() -> Iterator[list]:
    """Every ``tinker.ServiceClient`` built inside is closed on the way out (the cookbook's loops
    never close theirs, which would hold their session and its run until the server's
    ``session_timeout_s``)."""
    import tinker

    made: list = []
    init = tinker.ServiceClient.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    tinker.ServiceClient.__init__ = recording
    try:
        yield made
    finally:
        tinker.ServiceClient.__init__ = init
        for client in made:
            client.close("success").result()


@contextlib.contextmanager
def _api_key() -> Iterator[None]:
    """``TINKER_API_KEY`` (which the SDK requires) set to :data:`KEY` inside the block when the
    caller has none; a key of the caller's is left as it is."""
    had = "TINKER_API_KEY" in os.environ
    if not had:
        os.environ["TINKER_API_KEY"] = KEY
    try:
        yield
    finally:
        if not had:
            os.environ.pop("TINKER_API_KEY", None)


def sl_rows(n: int = 16) -> list[dict]:
    """One short conversation, ``n`` times: the loop's NLL must fall as it fits it."""
    convo = [{"role": "user", "content": "Say the sequence."}, {"role": "assistant", "content": "abcabcabc 123"}]
    return [{"messages": convo} for _ in range(n)]


def rl_rows(n: int = 8) -> list[dict]:
    """GSM8K-shaped rows (``question``, ``answer`` with ``#### N``)."""
    return [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i % 10}"} for i in range(n)]


def digit_reward(response: str, answer: str) -> float:
    """The share of digits in ``response``: ~10% of an untrained character model's output, so
    groups of a few samples have reward variance and the RL loop trains."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def run_sl_loop(base_url: str, model_dir: str, log_path: str, **config) -> None:
    """tinker-cookbook's ``sl_loop.main`` on :func:`sl_rows` (``config``: ``sl_loop.Config`` fields)."""
    from tinker_cookbook.recipes import sl_loop

    register_tokenizer(model_dir)
    settings = {"batch_size": 2, "learning_rate": 0.01, "lora_rank": 4, "save_every": 4, **config}
    with _api_key(), local_dataset(sl_rows()), closing_service_clients():
        sl_loop.main(sl_loop.Config(base_url=base_url, log_path=log_path, model_name=NAME, **settings))


def run_rl_loop(base_url: str, model_dir: str, log_path: str, reward: Callable[[str, str], float] = digit_reward, **config) -> None:
    """tinker-cookbook's ``rl_loop.main`` on :func:`rl_rows` with ``reward`` for its
    ``get_reward`` (``config``: ``rl_loop.Config`` fields; ``loss_fn`` may be any loss of the API)."""
    from tinker_cookbook.recipes import rl_loop

    register_tokenizer(model_dir)
    loss_fn = config.pop("loss_fn", "importance_sampling")
    settings = {"batch_size": 2, "group_size": 4, "max_tokens": 12, "lora_rank": 4, "save_every": 0, "max_steps": 4, **config}
    cfg = rl_loop.Config(base_url=base_url, log_path=log_path, model_name=NAME, **settings)
    object.__setattr__(cfg, "loss_fn", loss_fn)  # e.g. ppo: a loss of the API the recipe's type hint does not list
    real = rl_loop.get_reward
    rl_loop.get_reward = reward
    try:
        with _api_key(), local_dataset(rl_rows()), closing_service_clients():
            rl_loop.main(cfg)
    finally:
        rl_loop.get_reward = real


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinker_server.demo", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve", "sl_loop", "rl_loop"])
    parser.add_argument("--dir", default=DEFAULT_DIR, help=f"where the model, server state and loop logs go (default {DEFAULT_DIR})")
    parser.add_argument("--port", type=int, default=8000, help="serve: the port (default 8000)")
    parser.add_argument("--base-url", default=DEFAULT_URL, help=f"sl_loop / rl_loop: the server (default {DEFAULT_URL})")
    args = parser.parse_args(argv)
    model_dir = build_demo_model(args.dir)
    if args.command == "serve":
        from tinker_server.__main__ import main as serve

        config = Path(__file__).resolve().parents[1] / "configs" / "tinker_tiny.yaml"
        serve(
            [
                "--config",
                str(config),
                f"server.aliases=[{NAME}={model_dir}]",
                f"server.port={args.port}",
                f"server.state_dir={args.dir}/state",
            ]
        )
        return
    log = os.path.join(args.dir, args.command)
    (run_sl_loop if args.command == "sl_loop" else run_rl_loop)(args.base_url, model_dir, log)
    print(f"[enginekit] {args.command} done against {args.base_url}; metrics in {log}/metrics.jsonl", flush=True)


if __name__ == "__main__":
    main()
