"""The conformance kit: proves that a backend keeps the ``BaseEngine`` contract.

Run it against any backend, by registered name, entry-point name or import path::

    python -m engine_api.conformance fsdp
    python -m engine_api.conformance megatron --nproc 2 --set megatron.tensor_model_parallel_size=2
    python -m engine_api.conformance mypkg.engine:MyEngine --nproc 2

or from Python with :func:`run_conformance`. The checks (``engine_api.conformance.checks``)
are written against the contract only: HF log-prob parity, temperature and entropy, value
heads, HF names of exported weights, the update of one optimizer step against an independent
HF step for every micro-batching / dynamic batching / packing / split-call layout in all four
aggregation modes (at ``--nproc 2`` also DP-size invariance), abort, non-finite skip, bad-batch
rejection before any state change, frozen engines, offload round trips, exact resume in a
fresh process, and refusal of tampered checkpoints. The backend must load an HF causal-LM
directory (the kit builds a tiny Llama-style one; nothing is downloaded).
"""

from engine_api.conformance.checks import CHECKS
from engine_api.conformance.runner import Outcome, Report, run_conformance

__all__ = ["CHECKS", "Outcome", "Report", "run_conformance"]
