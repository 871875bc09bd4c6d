"""Peak memory of a colocated PPO step, with and without param/optimizer offload.

As in ``recipes.ppo``, three engines share one process: the actor (LM head, AdamW), the critic
(value head, AdamW) and the frozen reference. One PPO step runs reference log-probs, old
log-probs, values, the actor update and the critic update through the roles (``roles/``). The
measured step is the second one (the first allocates AdamW state). Every case runs in a fresh
spawned process, so one case's allocations never count for another.

What is measured, honestly:

* GPU: ``torch.cuda.max_memory_allocated`` over the actor update while the critic and the
  reference are resident (offload should move their params and optimizer state to the host,
  so this peak should drop).
* CPU: the process's resident set size (RSS): peak via ``/proc/self/status`` VmHWM after
  resetting it (``/proc/self/clear_refs``), else a 1 ms psutil sampler. On a CPU-only
  machine the compute device *is* host memory, so offload cannot lower it: the FSDP engine
  finds params already "on CPU" and moves nothing; the Megatron engine frees each storage but
  keeps a host copy of the same bytes in the same RAM. The CPU rows therefore show what offload
  costs (copies, transient doubles), not what it saves.

Run: ``.venv/bin/python -m benchmarks.memory [--backends fsdp megatron] [--json out.json]``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import tempfile
import threading
import time

import torch

from benchmarks.common import ModelSpec, Report, Row, build_model, cli, command_line, emit, set_threads

SPEC = ModelSpec(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688)
N_SEQ, PROMPT, RESPONSE = 8, 96, 32
MB = 2**20
LORA_RANK = 8


class PeakMemory:
    """Peak memory between :meth:`reset` and :meth:`peak`: CUDA allocator peak on GPU, RSS on CPU."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self._sampler: threading.Thread | None = None
        self._sampled = 0
        self._stop = threading.Event()

    def current(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated()
        import psutil

        return psutil.Process().memory_info().rss

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux: resets VmHWM (peak RSS) to the current RSS
        except OSError:
            self._start_sampler()

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            return self._sampled
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

    def _start_sampler(self) -> None:
        self._stop.clear()
        self._sampled = self.current()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._sampled = max(self._sampled, self.current())

        self._sampler = threading.Thread(target=sample, daemon=True)
        self._sampler.start()


def _ppo_batch(vocab: int):
    """Prompts + responses with the fields the roles' updates need (advantages, returns)."""
    from engine_api import make_batch

    g = torch.Generator().manual_seed(0)
    n = PROMPT + RESPONSE
    seqs = [torch.randint(0, vocab, (n,), generator=g) for _ in range(N_SEQ)]
    mask = [torch.cat([torch.zeros(PROMPT), torch.ones(RESPONSE)]) for _ in range(N_SEQ)]
    return make_batch(seqs, loss_mask=mask, advantages=[torch.randn(n, generator=g) for _ in range(N_SEQ)])


def _roles(path: str, backend: str, offload: bool, lora_rank: int = 0):
    """Actor, critic and reference engines as ``recipes.ppo`` configures them (critic: value
    head; reference: frozen), all with the same offload policy. ``lora_rank`` > 0: the actor
    trains LoRA adapters and the reference is the actor's engine with them off (no third model);
    the critic stays a full model."""
    from engine_api import build_engine, load_config
    from roles.actor import Actor, ActorConfig
    from roles.critic import Critic, CriticConfig
    from roles.reference import Reference

    base = load_config(
        None,
        [f"strategy={backend}", f"model.path={path}", "optim.lr=1e-4", f"offload.param={offload}", f"offload.optimizer={offload}"]
        + (["megatron.layer_spec=local"] if backend == "megatron" else []),
    )
    critic_cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, head="value"))
    if lora_rank:
        lora = dataclasses.replace(base.model.lora, rank=lora_rank, alpha=2.0 * lora_rank)
        actor_cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, lora=lora))
        engines = [build_engine(c) for c in (actor_cfg, critic_cfg)]
    else:
        engines = [build_engine(c) for c in (base, critic_cfg, dataclasses.replace(base, frozen=True))]
    for engine in engines:
        engine.init_model()
    reference = Reference(engines[0] if lora_rank else engines[2])
    return Actor(engines[0], ActorConfig(kl_coef=0.01)), Critic(engines[1], CriticConfig()), reference


def _ppo_step(actor, critic, reference, batch, meter: PeakMemory) -> dict[str, int]:
    """One colocated PPO step; the peak of each phase."""
    from engine_api.batch import unpack

    peaks = {}
    meter.reset()
    ids = batch["input_ids"]
    batch.set("ref_log_probs", unpack(reference.compute_log_probs(batch)["log_probs"].values(), ids))
    batch.set("old_log_probs", unpack(actor.compute_log_probs(batch)["log_probs"].values(), ids))
    values = critic.compute_values(batch)["values"].values()
    batch.set("values", unpack(values, ids))
    batch.set("returns", unpack(values.detach() + 1.0, ids))
    peaks["prepare"] = meter.peak()
    meter.reset()
    actor.update(batch)
    peaks["actor_update"] = meter.peak()
    meter.reset()
    critic.update(batch)
    peaks["critic_update"] = meter.peak()
    return peaks


def measure(path: str, backend: str, offload: bool, threads: int, lora_rank: int = 0) -> dict[str, float]:
    """Runs in a fresh spawned process: build the roles, one warm-up step, one measured step."""
    set_threads(threads)
    meter = PeakMemory()
    actor, critic, reference = _roles(path, backend, offload, lora_rank)
    batch = _ppo_batch(SPEC.vocab_size)
    _ppo_step(actor, critic, reference, batch.clone(), meter)  # allocates AdamW state
    before = meter.current()
    peaks = _ppo_step(actor, critic, reference, batch.clone(), meter)
    return {
        "rest_mb": before / MB,
        **{f"{k}_peak_mb": v / MB for k, v in peaks.items()},
        "after_mb": meter.current() / MB,
        "actor_optim_state_mb": _optimizer_state_bytes(actor.engine) / MB,
    }


def _optimizer_state_bytes(engine) -> int:
    """This rank's bytes of optimizer state (AdamW moments; the step counters left out)."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return 0
    total = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total


def main(argv=None) -> Report:
    parser = cli(__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["fsdp", "megatron"], choices=["fsdp", "megatron"])
    args = parser.parse_args(argv)
    start = time.perf_counter()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (RSS)"
    state_mb = SPEC.params() * 4 / MB
    report = Report(
        benchmark="memory",
        title=f"Memory: colocated PPO step (actor + critic + reference), offload off vs on, {device}",
        command=command_line("benchmarks.memory", argv),
        setup=(
            f"{SPEC.describe()}: fp32 params {state_mb:.0f} MB per copy (actor and critic also hold grads + 2 AdamW moments); "
            f"{N_SEQ} sequences of {PROMPT} prompt + {RESPONSE} response tokens; KL to the reference on; second PPO step measured; "
            "each case in a fresh process."
        ),
    )
    with tempfile.TemporaryDirectory(prefix="ek_bench_") as tmp:
        path = build_model(tmp, SPEC)
        for backend in args.backends:
            results = {}
            for offload in (False, True):
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    results[offload] = pool.submit(measure, path, backend, offload, args.threads).result()
            if backend == "fsdp":  # LoRA: adapters on the actor, the reference = the actor with them off
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    results["lora"] = pool.submit(measure, path, backend, False, args.threads, LORA_RANK).result()
            for offload, r in results.items():
                delta = r["actor_update_peak_mb"] - results[False]["actor_update_peak_mb"]
                if offload == "lora":
                    report.rows.append(
                        Row(
                            case=f"{backend}, LoRA r={LORA_RANK} (no reference copy)",
                            values={**r, "actor_peak_vs_off_mb": delta},
                            target="actor optimizer state adapter-sized; lower rest than two full copies",
                            met=r["actor_optim_state_mb"] < 0.1 * results[False]["actor_optim_state_mb"],
                            note="reference = the actor's engine with adapters off; critic full",
                        )
                    )
                    continue
                report.rows.append(
                    Row(
                        case=f"{backend}, offload {'on' if offload else 'off'}",
                        values={**r, "actor_peak_vs_off_mb": delta},
                        target="offload lowers the device peak (GPU only)",
                        met=(delta < 0) if (torch.cuda.is_available() and offload) else None,
                        note="" if torch.cuda.is_available() else "CPU: host = device, offload cannot lower RSS (see notes)",
                    )
                )
    report.notes.append(
        "rest_mb: RSS (or CUDA allocated) before the measured step; *_peak_mb: peak during each phase; after_mb: after the step."
    )
    report.notes.append(
        "CPU: FSDP offload is a no-op (params and optimizer state already live in host memory); Megatron offload frees each "
        "storage after copying it to a host buffer in the same RAM, so RSS does not fall; the peak shows the transient copies."
    )
    report.seconds = time.perf_counter() - start
    emit(report, args.json)
    return report


if __name__ == "__main__":
    main()
