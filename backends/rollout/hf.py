"""``hf``: the plain-HF rollout backend (CPU or one GPU; KV cache, prompts batched by length).

Exactness over speed: the log-prob of each sampled token comes from the same forward that
sampled it, and prompts are batched only with prompts of the same length, so no row is padded
and no attention mask is needed: each row's logits are those of a forward of that sequence
alone (up to batched-matmul rounding). Every sample draws from its own ``torch.Generator``
seeded with ``sample_seed(seed, j)``, so what a prompt gets does not depend on its neighbours.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backends.hf import refusing_pickled_objects, resolve_attn_implementation, router_modules, router_parts
from backends.rollout.layout import HFLayout, refuse_larger_tokenizer
from engine_api.kit import NOT_ROUTED, BaseRollout, RolloutEngineConfig, Sample, SamplingParams, register_rollout, sample_seed

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@register_rollout("hf")
class HFRollout(HFLayout, BaseRollout):
    """An HF causal LM loaded from ``config.model_path`` on the compute device.

    A stop string is looked for in the decoded text of the last ``len(stop) + 8`` tokens, which
    holds it whenever those tokens decode to at least one character each on average (every
    tokenizer in use; byte-fallback pieces decode to less). No backend options.

    ``return_routing`` (an MoE model): forward hooks on the routers HF records
    ``router_logits`` from keep each forward's top-k indices, the prefill's for the prompt and
    each decoding step's for the token it feeds, so ``Sample.routed_experts`` is exactly the
    routing the sampling forwards used.
    """

    supports_routing = True

    def __init__(self, config: RolloutEngineConfig) -> None:
        super().__init__(config)
        if config.options:
            raise ValueError(f"rollout options {sorted(config.options)}: the hf backend has none; fix: remove them")
        if config.dtype not in _DTYPES:
            raise ValueError(f"rollout dtype = {config.dtype!r}: unknown; fix: use one of {', '.join(_DTYPES)}")
        hf_config = AutoConfig.from_pretrained(config.model_path)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        # The same attention choice as the FSDP engine (eager where sdpa would drop Gemma-2's
        # soft-capping), so samples come from the policy that is trained.
        attn = resolve_attn_implementation(hf_config, "auto", self.device.type)
        with refusing_pickled_objects(config.model_path):
            self.model = AutoModelForCausalLM.from_pretrained(
                config.model_path, config=hf_config, dtype=_DTYPES[config.dtype], attn_implementation=attn
            )
        self.model.to(self.device).eval()
        # HF runs past max_position_embeddings without an error (RoPE extrapolates), so only a
        # limit the caller set is enforced here.
        self._limit = config.max_model_len
        self._trace: dict[int, list[torch.Tensor]] | None = None  # MoE layer -> each forward's top-k
        if config.return_routing:
            self._watch_routers()
        self.tokenizer = None
        if config.tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
            refuse_larger_tokenizer(config.model_path, config.tokenizer_path, self.tokenizer)

    @property
    def max_model_len(self) -> int | None:
        return self._limit

    def _watch_routers(self) -> None:
        routers, index = router_modules(self.model)
        if not routers:
            raise ValueError(
                f"return_routing = True: {self.config.model_path} has no MoE routers to record; fix: actor.router_replay=off for a dense model"
            )
        self._trace = {layer: [] for layer, _ in routers}
        for layer, module in routers:
            module.register_forward_hook(lambda mod, args, out, layer=layer: self._note(layer, out, index))

    def _note(self, layer: int, out, index: int) -> None:
        parts = router_parts(out, index)
        if parts is None:
            raise RuntimeError(
                f"return_routing: the router of layer {layer} does not return its top-k indices (the family routes inside its "
                "MoE block); fix: actor.router_replay=off (or r2) for this model family"
            )
        self._trace[layer].append(out[parts[1]].detach().to("cpu", torch.long))

    def _apply_weights(self, weights: dict[str, torch.Tensor]) -> None:
        state = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():
                state[name].copy_(tensor.to(state[name].device, state[name].dtype))

    @torch.no_grad()
    def _prompt_log_probs(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for prompt in prompts:
            ids = prompt.to(self.device)[None]
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1))
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[torch.Tensor], params: SamplingParams, seeds: list[int]) -> list[list[Sample]]:
        if params.stop and self.tokenizer is None:
            raise ValueError("sampling params: stop strings need a tokenizer; fix: build the rollout with tokenizer_path")
        groups: dict[int, list[tuple[int, int]]] = {}
        for i, prompt in enumerate(prompts):
            for j in range(params.n):
                groups.setdefault(len(prompt), []).append((i, j))
        out: list[list[Sample | None]] = [[None] * params.n for _ in prompts]
        for members in groups.values():
            block = torch.stack([prompts[i] for i, _ in members]).to(self.device)
            gens = [torch.Generator().manual_seed(sample_seed(seeds[i], j)) for i, j in members]
            if self._trace is not None:
                for steps in self._trace.values():
                    steps.clear()
            sampled = self._sample_block(block, params, gens)
            routing = self._block_routing(len(members), block.shape[1], sampled) if self._trace is not None else [None] * len(members)
            for (i, j), (ids, lps, reason), routed in zip(members, sampled, routing, strict=True):
                out[i][j] = Sample(ids, lps, reason, self.weight_version, routed)
        return out  # type: ignore[return-value]

    def _sample_block(self, prompts: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]):
        """Decode a [B, P] block of equal-length prompts; rows that stopped keep being fed
        their last token (their later draws are discarded), so the block keeps one KV cache."""
        stop_ids = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=self.device)
        window = max((len(s) for s in params.stop), default=0) + 8
        # The forwards run in inference mode (the same kernels, so the same logits bit for bit,
        # without autograd's per-operation bookkeeping: a few percent of a tiny model's decode
        # step, measured); what they return is only read below, which makes plain tensors, so
        # no inference tensor reaches a sample.
        with torch.inference_mode():
            out = self.model(prompts, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        tokens, log_probs = [], []
        done = torch.zeros(len(prompts), dtype=torch.bool, device=self.device)
        lengths = torch.full((len(prompts),), params.max_tokens)
        stopped = torch.zeros(len(prompts), dtype=torch.bool)
        # Each sample's uniforms, one per position, drawn up front from its own generator: its
        # tokens depend on its seed alone (not on the block it shares), and one vectorized
        # inverse-CDF draw per position replaces a multinomial call per row (those calls cost
        # a tenth of a tiny GRPO step, measured).
        uniforms = torch.stack([torch.rand(params.max_tokens, generator=g, dtype=torch.float64) for g in gens])
        for step in range(params.max_tokens):
            logp = filtered_log_probs(logits.float() / params.temperature, params.top_k, params.top_p)
            token = inverse_cdf_draw(logp.exp().cpu(), uniforms[:, step]).to(self.device)
            if tokens:
                token = torch.where(done, tokens[-1], token)
            tokens.append(token)
            log_probs.append(logp.gather(1, token[:, None])[:, 0])
            ended = ~done & torch.isin(token, stop_ids)
            if params.stop:
                ended |= ~done & self._hits_stop_string(torch.stack(tokens, 1), params.stop, window)
            lengths[ended.cpu()] = step + 1
            stopped |= ended.cpu()
            done |= ended
            if bool(done.all()) or step + 1 == params.max_tokens:
                break
            with torch.inference_mode():
                out = self.model(token[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        ids, lps = torch.stack(tokens, 1).cpu(), torch.stack(log_probs, 1).float().cpu()
        return [
            (ids[r, : int(n)].clone(), lps[r, : int(n)].clone(), "stop" if stopped[r] else "length") for r, n in enumerate(lengths.tolist())
        ]

    def _block_routing(self, rows: int, prompt_len: int, sampled: list) -> list[torch.Tensor]:
        """Each sample's ``[P + R, L, k]`` routing from the block's forwards: the prefill's
        ``[rows * P, k]`` per layer, then one ``[rows, k]`` per decoding step (the token the step
        fed). A response's last token was never fed: its row is ``NOT_ROUTED``."""
        layers = []
        for steps in self._trace.values():
            prefill = steps[0].reshape(rows, prompt_len, -1)
            decoded = torch.stack(steps[1:], 1) if len(steps) > 1 else prefill[:, :0]
            layers.append(torch.cat([prefill, decoded], 1))  # [rows, P + forwards, k]
        per_token = torch.stack(layers, 2)  # [rows, P + forwards, L, k]
        out = []
        for r, (ids, _, _) in enumerate(sampled):
            fed = per_token[r, : prompt_len + len(ids) - 1]
            last = torch.full((1, *fed.shape[1:]), NOT_ROUTED, dtype=torch.long)
            out.append(torch.cat([fed, last]).clone())
        return out

    def _hits_stop_string(self, ids: torch.Tensor, stops: tuple[str, ...], window: int) -> torch.Tensor:
        """Rows whose newest token [B, T][:, -1] completes a stop string: one is in the decoded
        tail window and was not before that token."""
        hits = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
        for r, row in enumerate(ids[:, -window:].tolist()):
            now = self.tokenizer.decode(row, skip_special_tokens=False)
            before = self.tokenizer.decode(row[:-1], skip_special_tokens=False) if len(row) > 1 else ""
            hits[r] = any(s in now and now.count(s) > before.count(s) for s in stops)
        return hits

    def _shutdown(self) -> None:
        self.model = None


def filtered_log_probs(scaled_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``log_softmax`` of ``scaled_logits`` [B, V] restricted to the top-``k`` tokens (-1: all)
    and then to the smallest prefix of mass >= ``top_p`` (always the top token), renormalised:
    the distribution a token is sampled from (tokens outside it get -inf)."""
    logits = scaled_logits
    if top_k != -1 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logp = torch.log_softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        drop = torch.zeros_like(keep).scatter(-1, order, ~keep)
        logp = torch.log_softmax(logits.masked_fill(drop, float("-inf")), dim=-1)
    return logp


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (unnormalised weights >= 0) from the uniforms ``u``
    [B] in [0, 1): the first index whose cumulative weight exceeds ``u`` times the row's total.
    Computed in float64; a token of weight 0 (filtered by top-k / top-p) is never drawn, as the
    cumulative sum does not rise there."""
    cdf = probs.double().cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return token.clamp_(max=probs.shape[1] - 1)
