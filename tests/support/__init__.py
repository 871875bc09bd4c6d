"""What the tests share. Test modules (``test_*.py``) and ``conftest.py`` files import from here
(or from a helper module of their own folder), never from each other
(``tests/support/test_no_test_imports.py`` checks it).

* ``launch``: starting ranks and scripts: ``run_distributed`` runs a function on N gloo ranks
  (``RankError`` when one fails or hangs), in a long-lived world by default, new ranks with
  ``fresh=True``; ``run_script`` runs a script forked from the preloaded server by default,
  ``python`` / ``torchrun`` / ``torchrun_nodes`` start real interpreters the way users do
  (``mp_context``: the preloaded forkserver). One environment (``launch_env``) and one
  ``free_port`` for all of them. ``docs/testing.md`` says which to use when.
* ``worlds``: the long-lived 2- and 4-rank gloo worlds and the reset between tasks.
* ``forked``: scripts (``-m mod``, ``path.py``, ``-c code``) run in processes forked from the
  preloaded server, with their own argv, environment, output and exit code.
* ``costs``, ``timing``, ``inner_loop``: the fixed costs helpers record, the time report at the
  end of a run, and ``--in-process`` (``make test-fast``), loaded as plugins by ``tests/conftest.py``.
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
