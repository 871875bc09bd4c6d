"""Recipe setup that SFT and RL (``recipes.sft``, ``recipes.ppo``) share: the ``tiny_model`` and
``trainer`` config sections, joining the launcher's process group, and building the tiny model
when ``engine.model.path`` is null.

(The loop pieces they share are in ``recipes.trainer_utils``.)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine_api.dist import all_reduce, comm_device, ensure_process_group, is_initialized, launcher_world
from recipes import data as task
from recipes.tiny_model import FAMILIES, build_tiny_model

__all__ = ["TinyModelConfig", "TrainerConfig", "data_model_problems", "init_distributed", "rank", "save_hf", "with_model_path"]


# ---------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class TinyModelConfig:
    """The model built when ``engine.model.path`` is null (see ``recipes.tiny_model``).

    Attributes:
        family: ``llama`` (GQA, untied) or ``qwen2`` (qkv bias, tied embeddings).
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: dimensions.
        head_dim: per-head width; null: hidden_size / num_heads (the RL recipe raises it to
            32 for rollout.backend=vllm, whose CPU attention kernel needs >= 32).
        seed: weight-init seed.
    """

    family: str = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    head_dim: int | None = None
    seed: int = 0

    def _problems(self) -> list[str]:
        out = []
        if self.family not in FAMILIES:
            out.append(f"family = {self.family!r}: unknown model family; fix: use one of {', '.join(FAMILIES)}")
        if self.num_heads < 1 or self.hidden_size % self.num_heads:
            out.append(f"num_heads = {self.num_heads}: must divide hidden_size = {self.hidden_size}; fix: e.g. num_heads=4")
        if self.num_kv_heads < 1 or self.num_heads % max(self.num_kv_heads, 1):
            out.append(f"num_kv_heads = {self.num_kv_heads}: must divide num_heads = {self.num_heads}; fix: e.g. num_kv_heads=2")
        for name in ("num_layers", "intermediate_size"):
            if getattr(self, name) < 1:
                out.append(f"{name} = {getattr(self, name)}: must be positive; fix: use a value >= 1")
        return out


@dataclass(frozen=True)
class TrainerConfig:
    """The training loop.

    Attributes:
        total_steps: optimizer steps of the run.
        log_every: print a log line every this many steps (and at the last step).
        output_dir: run directory: metrics, the built tiny model, checkpoints.
        metrics_file: JSON-lines file name under ``output_dir`` (one line per step).
        checkpoint_every: save a checkpoint every this many steps and at the end (0: never).
        resume: continue from the newest checkpoint under ``<output_dir>/checkpoints`` that
            verifies (one that fails verification is skipped with a loud message; none
            verifying is an error). The metrics file is cut back to the resumed step and the
            replayed steps appended, so it stays one line per step; the data of each step is
            the same as in an uninterrupted run.
        progress_bar: show a tqdm bar on rank 0.
        max_consecutive_skips: stop with an error after this many consecutive steps whose
            optimizer step was skipped (non-finite loss or gradients); 0: never stop.
        val_every: score the validation data every this many steps (0: only at the end).
        save_hf: at the end, write the trained model as an HF directory (weights, config,
            tokenizer, generation config) to ``<output_dir>/hf`` (``recipes.common.save_hf``).
        save_hf_format: ``merged`` (full weights; with LoRA the adapters merged in) or
            ``adapter`` (a peft adapter directory; needs ``engine.model.lora.rank > 0``).
    """

    total_steps: int = 800
    log_every: int = 100
    output_dir: str = "outputs/sft_tiny"
    metrics_file: str = "metrics.jsonl"
    checkpoint_every: int = 0
    resume: bool = False
    progress_bar: bool = True
    max_consecutive_skips: int = 3
    val_every: int = 0
    save_hf: bool = False
    save_hf_format: str = "merged"

    def _problems(self) -> list[str]:
        out = []
        if self.total_steps < 1:
            out.append(f"total_steps = {self.total_steps}: must be positive; fix: e.g. 800")
        if self.log_every < 1:
            out.append(f"log_every = {self.log_every}: must be positive; fix: e.g. 100")
        if self.max_consecutive_skips < 0:
            out.append(f"max_consecutive_skips = {self.max_consecutive_skips}: negative; fix: use 0 (never stop) or a positive count")
        if self.save_hf_format not in ("merged", "adapter"):
            out.append(f"save_hf_format = {self.save_hf_format!r}: unknown; fix: use merged or adapter")
        if self.val_every < 0:
            out.append(f"val_every = {self.val_every}: negative; fix: use 0 (only at the end) or a step interval")
        if self.checkpoint_every < 0:
            out.append(f"checkpoint_every = {self.checkpoint_every}: negative; fix: use 0 (off) or a step interval")
        if not self.output_dir:
            out.append(f"output_dir = {self.output_dir!r}: empty; fix: name a directory, e.g. outputs/sft_tiny")
        if not self.metrics_file or os.sep in self.metrics_file:
            out.append(f"metrics_file = {self.metrics_file!r}: must be a plain file name; fix: e.g. metrics.jsonl")
        return out


def data_model_problems(cfg) -> list[str]:
    """Data files need a model directory with a tokenizer (the built tiny model has none); an
    adapter export needs LoRA."""
    out = []
    if cfg.trainer.save_hf_format == "adapter" and not cfg.engine.model.lora.enabled:
        out.append(
            "trainer.save_hf_format = 'adapter': the engine has no LoRA adapters (engine.model.lora.rank = 0); fix: "
            "save_hf_format=merged, or train with engine.model.lora.rank > 0"
        )
    if cfg.data.from_files and cfg.engine.model.path is None:
        return out + [
            "engine.model.path = None: data.train_files are tokenized with the model directory's own tokenizer, and the built "
            "tiny model has none; fix: engine.model.path=DIR (an HF model directory with its tokenizer)"
        ]
    return out


# ---------------------------------------------------------------------------------- setup
def init_distributed(timeout_s: float | None = None) -> bool:
    """Join the launcher's process group (torchrun) with the collective timeout ``timeout_s``
    (``engine.dist_timeout_s``); return whether this call created it, so the recipe tears
    down only what it set up.

    Single-process runs create nothing here; the engine makes its own 1-rank group.
    """
    if is_initialized() or launcher_world() is None:
        return False
    backend = "gloo"
    if torch.cuda.is_available():
        # One GPU per process; NCCL collectives run on the current device.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    ensure_process_group(backend, timeout_s)
    return True


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def with_model_path(cfg):
    """``cfg`` unchanged when ``engine.model.path`` is set; otherwise build the tiny model
    into ``<output_dir>/tiny_model`` (rank 0 writes, the others wait) and point at it.

    Works for any recipe config with ``engine``, ``tiny_model``, ``data`` (a
    ``recipes.data.DataConfig``) and ``trainer`` fields (SFT and PPO).
    """
    if cfg.engine.model.path is not None:
        return cfg
    path = os.path.join(cfg.trainer.output_dir, "tiny_model")
    if rank() == 0:
        tm = cfg.tiny_model
        build_tiny_model(
            path,
            family=tm.family,
            seed=tm.seed,
            vocab_size=task.VOCAB_SIZE,
            hidden_size=tm.hidden_size,
            num_layers=tm.num_layers,
            num_heads=tm.num_heads,
            num_kv_heads=tm.num_kv_heads,
            intermediate_size=tm.intermediate_size,
            head_dim=tm.head_dim,
            max_position_embeddings=max(64, task.max_seq_len(cfg.data)),
            bos_token_id=task.BOS,
            eos_token_id=task.EOS,
            pad_token_id=task.PAD,
        )
    if is_initialized():
        # Every rank loads the files rank 0 just wrote: nobody may read before they exist.
        dist.barrier()
    model = dataclasses.replace(cfg.engine.model, path=path)
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, model=model))


# ---------------------------------------------------------------------------------- export
def save_hf(source, engine_config, out_dir: str, fmt: str = "merged") -> str:
    """Write the trained model of ``source`` (an engine or a role) as an HF directory.
    Collective: every rank drains the export; rank 0 writes; every rank returns once the
    directory is complete.

    ``fmt``:
        * ``merged``: the weights ``source.export_weights()`` yields (with LoRA: merged, in the
          compute dtype of the engine's mixed-precision policy) as float32 safetensors, with the config, generation
          config and tokenizer of ``engine_config.model.path`` (the tokenizer only when that
          directory has one); rank 0 assembles the model in CPU memory.
        * ``adapter``: a peft adapter directory (``adapter_config.json``,
          ``adapter_model.safetensors``) from ``source.export_adapter_weights()``, plus the
          tokenizer; load it with ``PeftModel.from_pretrained(base, out_dir)``.

    The directory appears whole or not at all (written next to ``out_dir``, then renamed), and a
    previous ``out_dir`` is replaced only after the new one is complete.

    Raises:
        ValueError: (rank 0) an exported name is not a parameter of the HF model, a shape
            differs, or a parameter received no value; nothing is written then.
    """
    from transformers import AutoModelForCausalLM

    model_path = engine_config.model.path
    rank0 = rank() == 0
    problems, written, model, state = [], set(), None, {}
    if rank0:
        try:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            state = model.state_dict()
        except (OSError, ValueError) as exc:  # still drain the export below: it is collective
            problems.append(f"cannot load the HF model to write into: {exc}")
    if fmt == "adapter":
        adapters = {name: tensor for name, tensor in source.export_adapter_weights()}  # collective
        if model is not None:
            model = _peft_model_with(model, engine_config, adapters, problems)
    else:
        with torch.no_grad():
            for name, tensor in source.export_weights():  # drained on every rank: it is collective
                if model is None:
                    continue
                if name not in state or state[name].shape != tensor.shape:
                    got = "not a parameter" if name not in state else f"shape {tuple(tensor.shape)} != {tuple(state[name].shape)}"
                    problems.append(f"{name}: {got}")
                    continue
                state[name].copy_(tensor.to(torch.float32))
                written.add(state[name].data_ptr())
        problems += [f"{n}: no exported value" for n, t in state.items() if t.data_ptr() not in written]  # tied names share storage
    failed = torch.tensor([float(bool(problems))])
    if is_initialized():  # every rank learns whether rank 0 may write (none waits on a failed peer)
        failed = all_reduce(failed.to(comm_device(None)), "sum", None).cpu()
    if problems:
        raise ValueError(f"trainer.save_hf: the export does not match the HF model of {model_path!r}: " + "; ".join(problems[:5]))
    if failed.item():
        raise RuntimeError("trainer.save_hf: rank 0 found the export does not match the HF model (its error says how); nothing written")
    if rank0:
        _write_dir(out_dir, model, model_path)
    if is_initialized():
        dist.barrier()
    return out_dir


def _peft_model_with(model, engine_config, adapters: dict, problems: list[str]):
    """peft's model on ``model`` with the engine's LoRA settings and ``adapters`` loaded."""
    import peft

    from backends.fsdp.lora import peft_config  # the adapter format is peft's, whichever backend trained it

    wrapped = peft.get_peft_model(model, peft_config(engine_config.model.lora, engine_config.model.head))
    expected = set(peft.get_peft_model_state_dict(wrapped))
    try:
        result = peft.set_peft_model_state_dict(wrapped, adapters)
    except (RuntimeError, ValueError, KeyError) as exc:  # e.g. a shape mismatch; the other ranks must still learn of it
        problems.append(f"the adapters do not load into peft's model: {exc}")
        return wrapped
    problems += [f"{k}: not an adapter of the peft model" for k in result.unexpected_keys]
    problems += [f"{k}: no exported value" for k in sorted(expected - set(adapters))]
    return wrapped


def _write_dir(out_dir: str, model, model_path: str) -> None:
    """``model.save_pretrained`` + the tokenizer of ``model_path`` into ``out_dir``, atomically.

    An ``out_dir`` that is a symbolic link (an export directory placed on another disk) is
    replaced where it points, so the link stays valid; a leftover ``.tmp`` / ``.old`` that is a
    link is unlinked, never followed."""
    if os.path.islink(out_dir):
        out_dir = os.path.realpath(out_dir)
    tmp, old = f"{out_dir}.tmp", f"{out_dir}.old"
    _delete(tmp)
    model.save_pretrained(tmp)
    try:
        from recipes.text_data import load_tokenizer

        load_tokenizer(model_path).save_pretrained(tmp)
    except ValueError:
        pass  # a model directory without a tokenizer (the built tiny model): weights + config only
    if os.path.lexists(out_dir):  # lexists: a broken link is in the way of the rename too
        _delete(old)
        os.replace(out_dir, old)  # renames a link itself, never its target
    os.replace(tmp, out_dir)
    _delete(old)


def _delete(path: str) -> None:
    """Remove ``path`` if present: a symbolic link (broken or not) or a file is unlinked, never
    followed (``shutil.rmtree`` refuses a link, and with ``ignore_errors`` silently left it in the
    way of the next export's rename); a directory tree is removed best-effort."""
    import shutil

    if os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path)):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
