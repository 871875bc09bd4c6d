"""Side-by-side benchmarks of Enginekit against the baselines a user would otherwise write.

Every script measures *ratios within one run* (engine vs baseline, interleaved, median of N),
so concurrent load on a shared machine moves both sides together. Each script prints a table
and, with ``--json PATH``, writes its rows for :mod:`benchmarks.run_all`, which regenerates
``BENCHMARKS.md`` (``make bench``).

Scripts: :mod:`benchmarks.overhead` (engine vs hand-written FSDP2 / megatron-core loops),
:mod:`benchmarks.packing` (remove-padding vs padded), :mod:`benchmarks.dynamic_batching`
(balanced partition vs greedy), :mod:`benchmarks.memory` (colocated PPO roles, offload on/off),
:mod:`benchmarks.gpu_throughput` (tokens/s and MFU; GPU only).
"""
