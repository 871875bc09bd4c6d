"""The post-training library the recipes are built from: data, tasks, rewards, the tiny demo
model, loop utilities and model export.

Modules:
    * ``sort_task``: the built-in digit-sorting task (token ids, batches, prompts of a step).
    * ``data``: the user's data files, the model directory's tokenizer and chat template,
      and the step -> samples order, one concern per module (``text_data`` re-exports them).
    * ``rewards``: loading and calling (fenced) the user's reward functions, and the built-ins.
    * ``tasks``: where an RL step's prompts and rewards come from (the sorting task or files).
    * ``tiny_model``: a tiny, seeded HF causal LM built from a config (nothing downloaded), declared
      once (``TinyModelConfig``, the recipes' ``tiny_model`` section).
    * ``trainer_utils``: resume from the newest valid checkpoint, the metrics log, the skip guard.
    * ``dist``: joining the launcher's process group, this process's rank.
    * ``export``: the trained model as an HF directory (merged weights or a peft adapter).

What it may import: ``engine_api``, ``roles`` and third-party libraries. Never ``backends``
(it works on whichever backend trained the model, through the ``engine_api`` contract) and never
``recipes`` (the scripts are built on it, not the other way round); ``tests/test_import_graph.py``
holds both rules, lazy imports included.
"""
