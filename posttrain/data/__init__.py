"""The user's own data for the recipes: data files, HF datasets, the model directory's HF
tokenizer and chat template, and the step -> samples order. One concern per module:

    * ``config``: the ``data`` section (``DataConfig``) and its checks.
    * ``sources``: what a source entry names (files, patterns, directories, ``save_to_disk``
      directories, ``hf:`` datasets) and what is wrong with it, without reading rows.
    * ``rows``: reading the sources into rows (JSONL / JSON / Parquet / ``datasets``), with the
      row size bound (``data.max_row_bytes``).
    * ``tokenizer``: the model directory's tokenizer and the ids that end a response.
    * ``messages``: ShareGPT turns as chat messages; message content checked to be text.
    * ``encoder``: rows as token ids through the chat template (``ChatEncoder``): SFT loss masks,
      RL prompts.
    * ``sft``: the SFT samples of the files (``SFTDataset``) and their batches.
    * ``prompts``: the RL prompts of the files (``PromptDataset``, ``PromptSample``).
    * ``counts``: what ``data.overlong`` did at load, and its report.
    * ``order``: which samples step ``s`` takes (``StepOrder``).

``posttrain.text_data`` re-exports the public names of all of them (their home before the split).
This package imports none of its modules, so reading a config (``config``, ``sources``) loads no
tokenizer code.

Every rank reads and tokenizes every file (the rows are needed for rewards and validation on all
ranks); this is cheap next to training for datasets up to a few 100k rows.
"""
