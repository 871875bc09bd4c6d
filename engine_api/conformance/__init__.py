"""The conformance kit: proves that a backend keeps the ``BaseEngine`` contract.

Run it against any backend, by registered name, entry-point name or import path::

    python -m engine_api.conformance fsdp
    python -m engine_api.conformance megatron --nproc 2 --set megatron.tensor_model_parallel_size=2
    python -m engine_api.conformance mypkg.engine:MyEngine --nproc 2

or from Python with :func:`run_conformance`. The checks (one module per topic, written with
``engine_api.conformance.checks``) are written against the contract only: HF log-prob parity, temperature and entropy, value
heads, HF names of exported weights, the update of one optimizer step against an independent
HF step for every micro-batching / dynamic batching / packing / split-call layout in all four
aggregation modes (at ``--nproc 2`` also DP-size invariance), the model's dropout in train
mode, abort, non-finite skip (a NaN loss, and an inf loss with finite gradients), the LR
schedule applied and reported (across a save and load too), bad-batch rejection before any
state change, frozen engines, offload round trips that release the loaded storage, exact
resume in a fresh process (with dropout: the RNG state too), a save before the first step
that changes nothing, a step that overflows the weights refused until a load, ``unshard_data``
in row order, bf16 mixed precision (``precision_checks``: exact fp32 start weights, bf16
compute, the step against the fp32 reference, bit-exact save/load), and refusal of tampered
checkpoints. The backend must load an HF causal-LM
directory (the kit builds a tiny Llama-style one; nothing is downloaded).

Rollout backends (``engine_api.rollout.BaseRollout``) have their own kit
(``engine_api.conformance.rollout_kit``: the fixtures; ``rollout_checks``; ``rollout_runner``: :func:`run_rollout_conformance`)::

    python -m engine_api.conformance --rollout vllm
"""

# isort: off
# Importing a topic's module registers its checks in CHECKS, and the kit runs them in that order:
# what the engine computes first, then the step, the failure paths, LoRA and runs, offload,
# checkpoints and bf16. These imports keep this order (the sorter is off for them).
from engine_api.conformance import output_checks, update_checks, safety_checks, lora_checks  # noqa: F401
from engine_api.conformance import offload_checks, checkpoint_checks, precision_checks  # noqa: F401

# isort: on
from engine_api.conformance.checks import CHECKS
from engine_api.conformance.rollout_kit import ROLLOUT_CHECKS
from engine_api.conformance.rollout_runner import RolloutReport, run_rollout_conformance
from engine_api.conformance.runner import Outcome, Report, run_conformance

__all__ = ["CHECKS", "ROLLOUT_CHECKS", "Outcome", "Report", "RolloutReport", "run_conformance", "run_rollout_conformance"]
