"""What the tests share. Test modules (``test_*.py``) and ``conftest.py`` files import from here
(or from a helper module of their own folder), never from each other
(``tests/support/test_no_test_imports.py`` checks it).

* ``launch``: starting ranks, both ways: ``run_distributed`` runs a function on N spawned gloo
  ranks (``RankError`` when one fails or hangs; ``mp_context`` for the preloaded forkserver);
  ``python`` / ``torchrun`` / ``run_script`` / ``torchrun_nodes`` start scripts the way users
  do. One environment (``launch_env``) and one ``free_port`` for all of them.
* ``hf_utils``: tiny HF models and batches, engines on them, direct HF references (log-probs,
  values, one optimizer step) and comparisons.
* ``megatron_workers``: the megatron tests' work in spawned ranks, their layouts, and the CUDA
  call sites the CPU compat layer is known to redirect (``KNOWN_CUDA_SITES``).
* ``user_data``: a user's model directory, tokenizer and data files, built offline.
* ``object_collectives``: ``no_object_collectives()``, which makes pickled collectives raise.
* ``ckpt_protocol``: checkpoints through the real layout protocol with stand-in shard files.
* ``role_engines``: the tiny FSDP engine the role tests drive, and old log-probs for a batch.

A folder's own suite helpers stay in that folder (``tests/reliability/_step_common.py``,
``_ckpt_*.py``, ``tests/backends/moe_utils.py``, ``gpu_step.py``); ``tests/reference_engine.py``
and ``tests/conformance/broken_*.py`` stay where the docs point.
"""
