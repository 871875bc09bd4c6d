"""What checkpoint integrity costs: hashing every file into the manifest at save, and checking
it (sha256, plus the scan for code) before a load, in seconds per GB of checkpoint, next to the
save and load themselves.

One FSDP engine (one process, gloo) trains one step so its checkpoint holds the model and AdamW
state; then, interleaved over rounds: ``load_checkpoint`` with ``checkpoint.verify`` true and
false (the difference is the sha256 pass), ``ckpt_integrity.verify`` alone with and without
hashing, and the manifest hashing of a save (``write_manifest``) alone. Page cache: every file
was just written or read, so these are hashing (CPU) costs, not disk reads; on a cold remote
filesystem the extra read of the checkpoint adds its transfer time.

Run: ``.venv/bin/python -m benchmarks.checkpoint_verify [--quick] [--json out.json]``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time

from benchmarks.common import (
    ModelSpec,
    Report,
    Row,
    build_fsdp_engine,
    build_model,
    cli,
    command_line,
    emit,
    interleaved_times,
    random_batch,
    set_threads,
)

SPEC = ModelSpec(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1376)
GB = 1e9


def _size(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(directory) for n in names)


def run(quick: bool) -> Report:
    from engine_api import ckpt_integrity, ckpt_layout

    rounds = 2 if quick else 5
    report = Report(
        benchmark="checkpoint_verify",
        title="Checkpoint integrity: manifest at save, verification at load",
        command=command_line("benchmarks.checkpoint_verify"),
        setup=f"{SPEC.describe()}, FSDP engine, 1 process, fp32 + AdamW state; {rounds} interleaved rounds, medians.",
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_ckpt_") as tmp:
        path = build_model(os.path.join(tmp, "model"), SPEC)
        engine = build_fsdp_engine(path)
        with engine.train_mode():
            engine.train_batch(random_batch([128] * 8, SPEC.vocab_size))
        root = os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        engine.save_checkpoint(root, global_step=1)
        save_s = time.perf_counter() - t0
        ckpt = ckpt_layout.latest_checkpoint(root)
        gb = _size(ckpt) / GB
        plain = dataclasses.replace(engine.config, checkpoint=dataclasses.replace(engine.config.checkpoint, verify=False))
        hashed_cfg = engine.config
        scratch = os.path.join(tmp, "manifest_copy")
        shutil.copytree(ckpt, scratch)

        def load(cfg):
            def call():
                engine.config = cfg
                engine.load_checkpoint(ckpt)

            return call

        cases = {
            "load, verify=true": load(hashed_cfg),
            "load, verify=false": load(plain),
            "verify, sha256": lambda: ckpt_integrity.verify(ckpt, ckpt_layout.MARKER, True),
            "verify, sizes + scan": lambda: ckpt_integrity.verify(ckpt, ckpt_layout.MARKER, False),
            "manifest at save": lambda: ckpt_integrity.write_manifest(scratch, exclude=(ckpt_layout.MARKER,)),
        }
        times = interleaved_times(cases, rounds=rounds, warmup=1)
        engine.config = hashed_cfg
    med = {name: statistics.median(t.wall) for name, t in times.items()}
    extra = med["load, verify=true"] - med["load, verify=false"]
    report.rows = [
        Row("save_checkpoint (incl. the manifest)", {"GB": round(gb, 3), "save_s": round(save_s, 3), "s_per_GB": round(save_s / gb, 2)}),
        Row("manifest at save (sha256 of every file)", {"s_per_GB": round(med["manifest at save"] / gb, 3)}),
        Row("verify at load, sha256", {"s_per_GB": round(med["verify, sha256"] / gb, 3)}),
        Row("verify at load, sizes + scan for code only", {"s_per_GB": round(med["verify, sizes + scan"] / gb, 3)}),
        Row(
            "load_checkpoint, verify=true vs false (s_per_GB: the difference)",
            {
                "s_per_GB_true": round(med["load, verify=true"] / gb, 3),
                "s_per_GB_false": round(med["load, verify=false"] / gb, 3),
                "ratio": round(med["load, verify=true"] / med["load, verify=false"], 3),
                "s_per_GB": round(extra / gb, 3),
            },
        ),
    ]
    report.notes = [
        "Wall-clock medians on a warm page cache: the hashing cost is CPU (sha256 in Python's hashlib, one pass per byte); "
        "the ranks of a multi-process job split the files between them, so each rank hashes about 1/world of the checkpoint.",
        "verify=false keeps the name and size check and the scan for code (every pickle parsed without the power to run code); "
        "only the sha256 comparison is skipped, so flipped bits in a shard would load.",
    ]
    return report


def main(argv=None) -> None:
    args = cli(__doc__.splitlines()[0]).parse_args(argv)
    set_threads(args.threads)
    t0 = time.perf_counter()
    report = run(args.quick)
    report.seconds = time.perf_counter() - t0
    emit(report, args.json)


if __name__ == "__main__":
    main()
