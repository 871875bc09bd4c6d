"""The user's own data for the recipes, under its first name: every public name of the
``posttrain.data`` modules (the data section, sources, rows, tokenizer, chat encoding, SFT and RL
samples, counts, order; see that package's docstring), re-exported.

Kept, not removed, for compatibility: the recipes (``recipes.ppo``, ``recipes.sft``,
``recipes.generate``), ``posttrain.tasks``, ``posttrain.export``, the tests, the docs and users'
scripts import these names from here, and one import path for the whole data API reads well in a
recipe. New library code may import the module that holds a name (``posttrain.data.rows`` for
``read_rows``); both are the same objects.
"""

from __future__ import annotations

from posttrain.data.config import FORMATS, LOSS_ON, MAX_ROW_BYTES, OVERLONG, DataConfig
from posttrain.data.counts import LoadCounts, report_counts
from posttrain.data.encoder import ChatEncoder
from posttrain.data.messages import SHAREGPT_ROLES, SHAREGPT_TOOL_TURNS, sharegpt_to_messages
from posttrain.data.order import StepOrder
from posttrain.data.prompts import PromptDataset, PromptSample
from posttrain.data.rows import Row, read_rows
from posttrain.data.sft import SFTDataset
from posttrain.data.sources import EXTENSIONS, HF_PREFIX, INSTALL_DATASETS, expand_files, parse_hf_source, saved_dataset_kind
from posttrain.data.tokenizer import load_tokenizer, stop_token_ids

__all__ = [
    "EXTENSIONS",
    "FORMATS",
    "HF_PREFIX",
    "INSTALL_DATASETS",
    "LOSS_ON",
    "MAX_ROW_BYTES",
    "OVERLONG",
    "SHAREGPT_ROLES",
    "SHAREGPT_TOOL_TURNS",
    "ChatEncoder",
    "DataConfig",
    "LoadCounts",
    "PromptDataset",
    "PromptSample",
    "Row",
    "SFTDataset",
    "StepOrder",
    "expand_files",
    "load_tokenizer",
    "parse_hf_source",
    "read_rows",
    "report_counts",
    "saved_dataset_kind",
    "sharegpt_to_messages",
    "stop_token_ids",
]
