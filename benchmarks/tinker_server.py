"""The Tinker server's overhead: ``forward_backward`` + ``optim_step`` of 64 datums and a
``sample`` call through the official SDK and the HTTP server, against the same calls on an
``EngineRun`` in process (the training side the server drives), as ratios in one run.

Both sides run in this process on the same machine, one after the other per round (alternating,
so drift hits both), on a small Llama-style model (4 layers, hidden 256, vocab 512, fp32, FSDP,
LoRA rank 16) with 64 datums of 96-160 tokens; medians over the rounds after a warm-up.

Run: ``.venv/bin/python -m benchmarks.tinker_server [--quick]`` (needs the tinker extra).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report, Row, cli, command_line, emit, set_threads

TARGET = 1.10
DATUMS, RANK, VOCAB = 64, 16, 512
ADAM = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0)


def _datums(seed: int):
    from tinker import types

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(DATUMS):
        n = int(torch.randint(96, 161, (1,), generator=g))
        tokens = torch.randint(0, VOCAB, (n,), generator=g)
        targets = torch.randint(0, VOCAB, (n,), generator=g)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens.tolist()), loss_fn_inputs={"target_tokens": targets, "weights": torch.ones(n)}
            )
        )
    return out


def _plain(datums):
    from tinker_server.contract import DatumIn

    return [
        DatumIn(torch.tensor(d.model_input.to_ints()), {k: torch.as_tensor(v.to_torch()) for k, v in d.loss_fn_inputs.items()})
        for d in datums
    ]


def main(argv=None) -> Report:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    set_threads(args.threads)
    import os

    import tinker
    from tinker import types

    from posttrain.tiny_model import build_tiny_model
    from tests.support.tinker import KEY, running_server
    from tinker_server.config import load_server_config
    from tinker_server.contract import AdamIn, LoraIn, SampleParamsIn
    from tinker_server.factory import EngineFactory
    from tinker_server.snapshots import RolloutPool as _RolloutPool
    from tinker_server.snapshots import snapshot

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    rounds = 3 if args.quick else 8
    start = time.perf_counter()
    report = Report(
        benchmark="tinker_server",
        title="Tinker server: SDK + HTTP vs the same calls in process (FSDP, LoRA)",
        command=command_line("benchmarks.tinker_server", argv),
        setup=(
            f"Llama-style model (4 layers, hidden 256, vocab {VOCAB}), LoRA rank {RANK}, fp32 CPU; forward_backward + optim_step "
            f"of {DATUMS} datums (96-160 tokens, cross_entropy); sample: {DATUMS} samples x 32 tokens; {rounds} rounds after a warm-up, "
            "medians, sides alternating"
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_tinker_") as tmp:
        root = Path(tmp) / "models"
        build_tiny_model(root / "m", family="llama", vocab_size=VOCAB, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         intermediate_size=512, max_position_embeddings=256)  # fmt: skip
        # engine.share=false: the direct run gets an engine of its own (a shared one would swap between the two)
        cfg = load_server_config(
            None, [f"server.model_root={root}", f"server.state_dir={tmp}/state", "server.max_runs=4", "engine.share=false"]
        )
        factory = EngineFactory(cfg.server.model_root, {}, cfg.run_settings())
        with running_server(cfg.server_settings(), factory) as url:
            service = tinker.ServiceClient(base_url=url, api_key=KEY)
            client = service.create_lora_training_client(base_model="m", rank=RANK, seed=0).result()
            direct = factory.create_run("m", LoraIn(rank=RANK, seed=0))
            sampler = client.save_weights_and_get_sampling_client().result()
            # its own rollout engine: sharing the server's would re-sync the weights on every switch
            direct_sampler = snapshot(_RolloutPool(str(root / "m"), factory.settings), "m", direct.merged_weights(), None)
            prompt = list(range(1, 33))
            times = {k: [] for k in ("fb_server", "fb_direct", "sample_server", "sample_direct")}
            served = factory.created[0]  # the client's run (the direct one was built after it)
            fidelity = {"loss": 0.0, "logprobs": 0.0, "samples_differ": 0}
            for r in range(rounds + 1):
                data = _datums(r)
                plain = _plain(data)
                t = time.perf_counter()
                got = client.forward_backward(data, "cross_entropy").result()
                client.optim_step(types.AdamParams(**ADAM)).result()
                fb_server = time.perf_counter() - t
                t = time.perf_counter()
                want = direct.forward_backward(plain, "cross_entropy", None, False)
                direct.optim_step(AdamIn(**ADAM))
                fb_direct = time.perf_counter() - t
                params = types.SamplingParams(max_tokens=32, seed=r, temperature=1.0)
                t = time.perf_counter()
                sampled = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=DATUMS, sampling_params=params).result()
                s_server = time.perf_counter() - t
                t = time.perf_counter()
                direct_sampled = direct_sampler.sample(prompt, DATUMS, SampleParamsIn(max_tokens=32, seed=r), False)
                s_direct = time.perf_counter() - t
                a, b = got.metrics["loss:sum"], want.metrics["loss:sum"]
                fidelity["loss"] = max(fidelity["loss"], abs(a - b) / abs(b))
                for g, w in zip(got.loss_fn_outputs, want.outputs, strict=True):
                    fidelity["logprobs"] = max(
                        fidelity["logprobs"], float((torch.as_tensor(g["logprobs"].to_torch()) - w["logprobs"]).abs().max())
                    )
                fidelity["samples_differ"] += sum(
                    x.tokens != y.tokens for x, y in zip(sampled.sequences, direct_sampled.sequences, strict=True)
                )
                if r:  # round 0 warms both up
                    for key, value in zip(times, (fb_server, fb_direct, s_server, s_direct), strict=True):
                        times[key].append(value)
            ours, theirs = served.adapter_weights(), direct.adapter_weights()
            num = sum(float(((ours[k] - theirs[k]).double() ** 2).sum()) for k in theirs)
            fidelity["adapter"] = (num / sum(float((v.double() ** 2).sum()) for v in theirs.values())) ** 0.5
            service.close("success").result()
    report.rows.append(
        Row(
            case=f"fidelity over {rounds + 1} steps: server vs in process",
            values={
                "loss_rel_max": fidelity["loss"],
                "logprob_abs_max": fidelity["logprobs"],
                "adapter_rel": fidelity["adapter"],
                "samples_differing": fidelity["samples_differ"],
            },
            target="loss, log-probs, adapter <= 1e-5; seeded samples identical",
            met=max(fidelity["loss"], fidelity["logprobs"], fidelity["adapter"]) <= 1e-5 and fidelity["samples_differ"] == 0,
        )
    )
    med = {k: statistics.median(v) for k, v in times.items()}
    for case, server, direct in (
        ("forward_backward + optim_step, 64 datums", "fb_server", "fb_direct"),
        (f"sample, {DATUMS} x 32 tokens", "sample_server", "sample_direct"),
    ):
        ratio = med[server] / med[direct]
        report.rows.append(
            Row(
                case=case,
                values={"server_s": med[server], "in_process_s": med[direct], "server/in_process": ratio},
                target=f"<= {TARGET}x",
                met=ratio <= TARGET,
                samples={"server": times[server], "in_process": times[direct]},
            )
        )
    report.notes.append(
        "The server's extra work per call: protobuf encoding in the SDK and decoding here, the futures table and its long poll, "
        "one hop to the engine thread; the engine work is the same code on both sides."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
