"""LoRA on the megatron backend: peft's adapters, per HF projection, on megatron's fused linears.

peft adapts HF's separate projections (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ...),
each with its own ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``. megatron fuses them
(``linear_qkv`` interleaves q, k, v per query group; ``linear_fc1`` is ``[gate_r; up_r]`` per
TP rank) and splits them over tensor parallelism. A :class:`LinearAdapter` keeps one (A, B)
pair per adapted HF projection, so it trains exactly what peft trains, and adds
``alpha / r * B_p (A_p x)`` to the rows that projection owns in megatron's layout. Which local
rows those are is computed by running the converter's own import layout
(``convert.import_layout``) on row ids, so the adapters follow the weights' layout by
construction (Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are one projection each, as in
peft).

Tensor parallelism (megatron's mappings, so gradients are exact):

* column-parallel layers (``linear_qkv``, ``linear_fc1``, ``output_layer``): ``A`` is
  replicated, ``B`` holds this rank's rows. ``h = A x`` passes ``copy_to_tensor_model_parallel_region``
  (backward: all-reduce), so ``A``'s gradient is the whole sum on every rank; the output layer
  gathers its logits over TP, so its delta is gathered too.
* row-parallel layers (``linear_proj``, ``linear_fc2``): ``A`` holds this rank's input columns,
  ``B`` is replicated; ``A x`` is summed over TP (``reduce_from_tensor_model_parallel_region``)
  before ``B``.

Split tensors carry megatron's ``tensor_model_parallel`` attributes (the gradient norm counts a
replicated tensor once; export and the checkpoint gather by them). The padded vocabulary rows
of an adapted output layer get ``B`` rows too (zero, and their logits are dropped, so they stay
zero); export drops them.

Assumptions (refused otherwise at ``build_engine``, :func:`lora_problems`): the local layer spec
(the TE spec fuses the norm into the next linear, whose input is then not the adapter's input),
dense models (MoE experts are grouped weights peft does not adapt either), an LM head (a value
head's LoRA critic is the FSDP backend's for now), no adapter on a tied LM head, and no adapter
dropout under tensor parallelism (the replicated input would need one mask on every TP rank).

Initialisation: ``A`` as peft (Kaiming-uniform, ``a = sqrt(5)``), ``B`` zero; each full ``A`` is
drawn from its own generator seeded by the engine seed and the HF module name, then sliced: the
same adapters whatever the TP / PP / DP layout (not peft's draws: a run starts from its own
seed's adapters, which ``export_adapter_weights`` reports).

The adapters live in one module per model chunk, ``chunk.lora`` (:class:`ChunkAdapters`), whose
checkpoint keys are the HF module names (``lora/<hf module>/A``): stable across pipeline layouts.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from backends.megatron.convert import ArchInfo, import_layout, layer_rules, padded_vocab, rule_for
from backends.megatron.options import MegatronOptions
from engine_api.kit import EngineConfig, LoraConfig, format_problem, options_of

# The megatron linears that take adapters, and how they are split over TP.
_COLUMN = ("self_attention.linear_qkv", "mlp.linear_fc1", "output_layer")
_ROW = ("self_attention.linear_proj", "mlp.linear_fc2")
PEFT_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<hf module>.lora_A.weight


@dataclass(frozen=True)
class Part:
    """One adapted HF projection inside a megatron linear.

    Attributes:
        hf_module: the HF module name (``model.layers.3.self_attn.q_proj``, ``lm_head``).
        rows: the projection's full output rows in HF (``lora_B`` rows).
        cols: its full input columns (``lora_A`` columns).
        positions: this rank's local output rows of the fused megatron linear it owns, in the
            order of ``B``'s local rows (column-parallel layers; ``None`` for row-parallel).
    """

    hf_module: str
    rows: int
    cols: int
    positions: tuple[int, ...] | None


def matches(hf_module: str, targets: list[str]) -> bool:
    """peft's rule for a list of ``target_modules``: the name, or a dotted suffix of it."""
    if list(targets) == ["all-linear"]:
        return hf_module != "lm_head"  # peft's all-linear leaves the output layer out
    return any(hf_module == t or hf_module.endswith("." + t) for t in targets)


def adaptable_modules(arch: ArchInfo) -> list[str]:
    """Every HF module name the megatron backend can adapt in this model (dense layers' q/k/v/o
    and MLP projections, the LM head), in model order."""
    out = []
    for layer in range(arch.num_layers):
        rules = layer_rules(arch, False)
        for key in (*_COLUMN[:2], *_ROW):
            out += [f"model.layers.{layer}.{h.removesuffix('.weight')}" for h in rules[f"{key}.weight"].hf]
    return [*out, "lm_head"]


def lora_problems(config: EngineConfig, arch: ArchInfo, te: bool) -> list[str]:
    """What the megatron backend refuses with ``model.lora`` (module docstring), each with the fix."""
    lora = config.model.lora
    if not lora.enabled:
        return []
    out = []
    field = "model.lora.rank"
    if te:
        out.append(
            format_problem(
                field, lora.rank, "LoRA on megatron runs on the local layer spec", "set megatron.layer_spec=local, or strategy=fsdp"
            )
        )
    if arch.is_moe:
        out.append(
            format_problem(field, lora.rank, f"LoRA on a megatron MoE model ({arch.family})", "use strategy=fsdp for LoRA on MoE models")
        )
    if config.model.head != "lm":
        out.append(format_problem(field, lora.rank, "a LoRA critic (model.head=value) on megatron", "use strategy=fsdp for a LoRA critic"))
    tp = options_of(config, MegatronOptions).tensor_model_parallel_size
    if lora.dropout > 0 and tp > 1:
        out.append(
            format_problem(
                "model.lora.dropout",
                lora.dropout,
                "adapter dropout under tensor parallelism (the replicated input would need one mask on every TP rank)",
                "use model.lora.dropout=0 with megatron.tensor_model_parallel_size > 1",
            )
        )
    fused = len(layer_rules(arch, False)["self_attention.linear_qkv.weight"].hf) == 1
    if fused and tp > 1:
        out.append(
            format_problem(
                "megatron.tensor_model_parallel_size",
                tp,
                f"with LoRA on {arch.family}: its fused qkv_proj / gate_up_proj adapters would split over TP in pieces that are not one "
                "block of the projection",
                "use 1 (or strategy=fsdp)",
            )
        )
    names = adaptable_modules(arch)
    out += _stage_problems(config, arch, names)
    unmatched = [t for t in lora.target_modules if t != "all-linear" and not any(matches(n, [t]) for n in names)]
    if unmatched:
        out.append(
            format_problem(
                "model.lora.target_modules",
                list(lora.target_modules),
                f"{unmatched} match none of the linear layers the megatron backend adapts ({_suffixes(names)})",
                "name those projections, or use [all-linear]",
            )
        )
    if arch.tied and any(matches("lm_head", [t]) for t in lora.target_modules if t != "all-linear"):
        out.append(
            format_problem(
                "model.lora.target_modules",
                list(lora.target_modules),
                "lm_head shares the tied input/output embedding, and an adapter on it cannot merge into one weight",
                "drop lm_head from target_modules",
            )
        )
    return out


def _stage_problems(config: EngineConfig, arch: ArchInfo, names: list[str]) -> list[str]:
    """Every pipeline rank must hold an adapter (a rank with nothing to train has no optimizer);
    layers split evenly over PP x VPP stages, virtual stage ``v`` of rank ``r`` holding block
    ``v * PP + r``, the head on the last rank."""
    m = options_of(config, MegatronOptions)
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    if pp <= 1 or arch.num_layers % (pp * vpp):
        return []  # (an uneven split is refused by megatron_problems)
    per = arch.num_layers // (pp * vpp)
    targets = list(config.model.lora.target_modules)
    bare = []
    for rank in range(pp):
        layers = {(v * pp + rank) * per + i for v in range(vpp) for i in range(per)}
        held = [n for n in names if (n == "lm_head" and rank == pp - 1) or (n != "lm_head" and int(n.split(".")[2]) in layers)]
        if not any(matches(n, targets) for n in held):
            bare.append(rank)
    if not bare:
        return []
    return [
        format_problem(
            "model.lora.target_modules",
            targets,
            f"pipeline rank(s) {bare} of {pp} would hold no adapter (nothing to train there)",
            "adapt a module of every pipeline stage (e.g. [all-linear]), or use megatron.pipeline_model_parallel_size=1",
        )
    ]


def _suffixes(names: list[str]) -> str:
    return ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))


# --------------------------------------------------------------------------- the modules
class LinearAdapter(nn.Module):
    """The adapters of one megatron linear: ``A[j]`` / ``B[j]`` for ``parts[j]`` (module docstring)."""

    def __init__(self, parts: list[Part], column: bool, out_local: int, lora: LoraConfig, seed: int, dtype, device) -> None:
        super().__init__()
        self.parts, self.column, self.out_local = parts, column, out_local
        self.scale = lora.alpha / lora.rank
        self.dropout = lora.dropout
        self.enabled = True
        self.rank = lora.rank
        self.A, self.B = nn.ParameterList(), nn.ParameterList()
        for part, local_a in zip(parts, self._draw(seed), strict=True):
            if column:
                a = nn.Parameter(local_a.to(device=device, dtype=dtype))
                b = nn.Parameter(torch.zeros(len(part.positions), lora.rank, dtype=dtype, device=device))
                set_tensor_model_parallel_attributes(b, True, 0, 1)
            else:
                a = nn.Parameter(local_a.to(device=device, dtype=dtype))
                b = nn.Parameter(torch.zeros(part.rows, lora.rank, dtype=dtype, device=device))
                set_tensor_model_parallel_attributes(a, True, 1, 1)
            self.A.append(a)
            self.B.append(b)
        if column:
            positions = [p for part in parts for p in part.positions]
            self.register_buffer("positions", torch.tensor(positions, device=device), persistent=False)
            # (decided once: checking it per forward would sync a GPU every call)
            self.in_order = positions == list(range(out_local))

    def _draw(self, seed: int) -> list[torch.Tensor]:
        """Each part's initial ``A`` on this TP rank (fp32, CPU): kaiming-uniform from a generator
        seeded by ``seed`` and the HF projection's name, so every layout draws the same full A."""
        tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        out = []
        for part in self.parts:
            full_a = torch.empty(self.rank, part.cols, dtype=torch.float32)
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(part.hf_module.encode()))
            nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=gen)
            out.append(full_a if self.column else full_a.chunk(tp, dim=1)[tp_rank].clone())
        return out

    @torch.no_grad()
    def reset(self, seed: int) -> None:
        """The adapters as an engine built with ``seed`` draws them (``A`` drawn, ``B`` zero)."""
        for a, b, local_a in zip(self.A, self.B, self._draw(seed), strict=True):
            a.copy_(local_a)
            b.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output for the linear's input ``x`` (``[s, b, in_local]``): this rank's
        ``[s, b, out_local]`` (column) or the full ``[s, b, out]`` (row)."""
        tp = mpu.get_tensor_model_parallel_world_size()
        # peft draws one dropout mask per adapted projection
        h = torch.cat([(F.dropout(x, self.dropout, self.training) if self.dropout else x) @ a.t() for a in self.A], dim=-1)
        r = self.A[0].shape[0]
        if self.column:
            if tp > 1:
                h = copy_to_tensor_model_parallel_region(h)  # A's gradient summed over TP
            y = torch.cat([hj @ b.t() for hj, b in zip(h.split(r, dim=-1), self.B, strict=True)], dim=-1)
            if not self.in_order:
                y = y.new_zeros(*y.shape[:-1], self.out_local).index_copy(-1, self.positions, y)
        else:
            if tp > 1:
                h = reduce_from_tensor_model_parallel_region(h)
            y = h @ self.B[0].t()
        return y * self.scale

    def delta_weight(self, value=None) -> torch.Tensor:
        """``scale * B A`` in the linear's local weight layout (``[out_local, in_local]``), as
        peft's ``get_delta_weight`` per projection. ``value(param)``: the tensor to read for each
        adapter parameter (the fp32 mains under mixed precision; the parameters themselves by
        default)."""
        value = value or (lambda param: param)
        with torch.no_grad():
            a_s, b_s = [value(a) for a in self.A], [value(b) for b in self.B]
            if not self.column:
                return self.scale * b_s[0] @ a_s[0]
            delta = torch.cat([b @ a for a, b in zip(a_s, b_s, strict=True)])
            return self.scale * delta.new_zeros(self.out_local, delta.shape[1]).index_copy(0, self.positions, delta)


class ChunkAdapters(nn.Module):
    """Every :class:`LinearAdapter` of one model chunk (``chunk.lora``), with checkpoint keys
    named by HF module (``lora/<hf module>/A`` and ``/B``)."""

    def __init__(self, adapters: Mapping[str, LinearAdapter]) -> None:
        super().__init__()
        self.names = list(adapters)  # the megatron linears' names in the chunk
        self.adapters = nn.ModuleList(adapters.values())

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron dist_checkpointing's view: split tensors sharded over TP along their
        partition dim, replicated ones replicated; keys independent of the PP layout."""
        out = {}
        for i, adapter in enumerate(self.adapters):
            for j, part in enumerate(adapter.parts):
                for kind, param in (("A", adapter.A[j]), ("B", adapter.B[j])):
                    key = f"lora/{part.hf_module}/{kind}"
                    local = f"{prefix}adapters.{i}.{kind}.{j}"
                    if getattr(param, "tensor_model_parallel", False):
                        out[local] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=param.partition_dim)
                    else:
                        out[local] = make_sharded_tensor_for_checkpoint(param, key)
        return out


def attach(
    chunks, arch: ArchInfo, hf_shapes: Mapping[str, tuple[int, ...]], lora: LoraConfig, seed: int, global_layer: Callable
) -> list[LinearAdapter]:
    """Freeze every base weight, give each targeted linear a :class:`LinearAdapter` (a forward
    hook adds its output) and register them as ``chunk.lora``. ``global_layer(chunk, name)``: the
    global layer index of a chunk's parameter (``model.global_layer``). Returns every adapter.

    The first stage's embedding output is marked as requiring grad: with the embedding frozen,
    megatron's full recompute (``model.gradient_checkpointing``, a reentrant checkpoint) would
    otherwise see layer inputs that need no gradient and give the adapters inside none (HF's
    ``enable_input_require_grads`` for the same reason)."""
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    every = []
    for chunk in chunks:
        chunk.requires_grad_(False)
        if getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_input_needs_grad)
        adapters = {}
        for name, module in chunk.named_modules():
            key = name.split(".", 3)[-1] if name.startswith("decoder.layers.") else name
            if key not in _COLUMN + _ROW or not hasattr(module, "weight"):
                continue
            rule, prefix, _ = rule_for(f"{name}.weight", arch, global_layer(chunk, f"{name}.weight"))
            if rule.layout == "copy":
                continue  # a value head (refused with LoRA) or a layer without a split
            parts = _parts(rule, prefix, arch, hf_shapes, lora, tp_rank, tp, column=key in _COLUMN)
            if not parts:
                continue
            weight = module.weight
            adapter = LinearAdapter(parts, key in _COLUMN, weight.shape[0], lora, seed, weight.dtype, weight.device)
            module.register_forward_hook(_hook(adapter, tp), with_kwargs=True)
            object.__setattr__(module, "_enginekit_lora", adapter)  # not a submodule: chunk.lora owns it
            adapters[name] = adapter
        chunk.lora = ChunkAdapters(adapters)
        every += list(adapters.values())
    return every


def _parts(rule, prefix: str, arch: ArchInfo, hf_shapes, lora: LoraConfig, tp_rank: int, tp: int, column: bool) -> list[Part]:
    """The targeted HF projections of one linear and, for a column-parallel one, the local rows
    each owns: the converter's import layout applied to row ids (1-based; 0 is TP padding)."""
    names = [prefix + h for h in rule.hf]
    if not any(matches(n.removesuffix(".weight"), lora.target_modules) for n in names):
        return []  # (before any shape is read: a tied head has no lm_head tensor of its own)
    shapes = [hf_shapes[n] for n in names]
    if not column:
        (shape,) = shapes
        module = names[0].removesuffix(".weight")
        return [Part(module, shape[0], shape[1], None)] if matches(module, lora.target_modules) else []
    if rule.layout == "vocab":
        module = names[0].removesuffix(".weight")
        if not matches(module, lora.target_modules):
            return []
        local = padded_vocab(arch.vocab, tp) // tp
        # B covers the padded rows too (zero, dropped on export) so every rank's B is one size.
        return [Part(module, shapes[0][0], shapes[0][1], tuple(range(local)))]
    offsets = [0]
    for shape in shapes:
        offsets.append(offsets[-1] + shape[0])
    ids = [torch.arange(lo + 1, hi + 1, dtype=torch.float64).unsqueeze(1) for lo, hi in zip(offsets, offsets[1:], strict=False)]
    local = import_layout(rule.layout, ids, arch, tp_rank, tp, arch.ffn)[:, 0].long() - 1
    parts = []
    for name, shape, lo, hi in zip(names, shapes, offsets, offsets[1:], strict=False):
        module = name.removesuffix(".weight")
        if not matches(module, lora.target_modules):
            continue
        positions = torch.nonzero((local >= lo) & (local < hi)).flatten()
        order = torch.argsort(local[positions])  # B's rows in the projection's own (HF) row order
        positions, rows = positions[order], local[positions[order]] - lo
        if not torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows))):
            # (a fused HF projection under TP: refused by lora_problems)
            raise AssertionError(f"{module}: this rank's rows are not one contiguous block of the projection")
        parts.append(Part(module, shape[0], shape[1], tuple(positions.tolist())))
    return parts


def _input_needs_grad(module, args, out):
    return out.requires_grad_() if torch.is_grad_enabled() and not out.requires_grad else out


def _hook(adapter: LinearAdapter, tp: int):
    def add(module, args, kwargs, output):
        if not adapter.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        delta = adapter(x)
        if adapter.column and tp > 1 and out.shape[-1] == adapter.out_local * tp:
            delta = gather_from_tensor_model_parallel_region(delta)  # the layer gathered its output
        return out + delta.to(out.dtype), bias

    return add


# --------------------------------------------------------------------------- export
def adapter_of(module: nn.Module) -> LinearAdapter | None:
    """The adapter attached to a megatron linear, if any."""
    return getattr(module, "_enginekit_lora", None)


def peft_items(adapter: LinearAdapter) -> Iterator[tuple[str, torch.Tensor, int]]:
    """``(peft_name, local tensor, rows to keep)`` of one adapter's tensors; the caller gathers
    the TP-split ones along their partition dim and keeps the first ``rows`` rows of a B (an
    output layer's B has TP-padding rows)."""
    for j, part in enumerate(adapter.parts):
        base = f"{PEFT_PREFIX}{part.hf_module}"
        yield f"{base}.lora_A.weight", adapter.A[j], adapter.A[j].shape[0]
        yield f"{base}.lora_B.weight", adapter.B[j], part.rows
