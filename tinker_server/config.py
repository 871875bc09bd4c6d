"""The Tinker server's settings: ``python -m tinker_server --config configs/tinker_tiny.yaml
[key=value ...]`` (docs/tinker.md). Typed and frozen; every bad value is reported with its key,
the value and the fix before anything starts."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from tinker_server import tenants
from tinker_server.contract import ServerSettings

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class RunSettings:
    """What every run of the server shares: the training side's settings (the ``engine.*``,
    ``rollout.*`` and ``tinker.*`` keys; :meth:`TinkerServerConfig.run_settings`).

    Attributes:
        strategy: ``engine.strategy`` of the runs (a backend that supports LoRA).
        engine_overrides: further ``engine.*`` settings (``key=value``), e.g. micro-batching.
        rollout_backend: ``rollout.backend`` of the samplers.
        rollout_lora_rank: > 0: sampling snapshots of runs up to this rank are their adapters,
            served on the base by the rollout engine's LoRA (``rollout.lora_rank``); 0: merged.
        rollout_max_loras: adapters the rollout engine keeps resident (``rollout.max_loras``).
        lora_alpha: LoRA alpha of every run (the update is ``alpha / rank * B A``).
        max_tokens: a sample's length when the request names none.
        ranks: the ranks of each run's engine (data parallel); above 1 a run is a Ray worker group
            that the server drives as its single controller (``tinker_server.ray_engine``).
        cpus_per_rank: CPUs each Ray worker reserves (fractions allowed; also its torch threads).
        ray_address: null starts a local Ray instance (stopped with the server); ``auto`` or
            ``HOST:PORT`` joins a running cluster.
        share: runs of one ``signature.Signature`` share one engine (``shared_engine.SharedEngine``
            in process, ``ray_engine.RayEngine`` on Ray workers).
        max_engines: engines held at once (shared or not); past it create_model is refused.
    """

    strategy: str = "fsdp"
    engine_overrides: tuple[str, ...] = ()
    rollout_backend: str = "hf"
    rollout_lora_rank: int = 0
    rollout_max_loras: int = 4
    lora_alpha: float = 32.0
    max_tokens: int = 64
    ranks: int = 1
    cpus_per_rank: float = 1.0
    ray_address: str | None = None
    share: bool = True
    max_engines: int = 2


@dataclass(frozen=True)
class ServerSection:
    """The HTTP side.

    Attributes:
        host: address to bind; 127.0.0.1 (this machine only) unless told otherwise.
        port: TCP port.
        api_keys: the keys a client may send (``tml-...``, the SDK's prefix); empty: any key.
        model_root: a directory of HF model directories; each is served under its directory name.
        aliases: further served names, each ``NAME=DIR`` (e.g. ``Qwen/Qwen3-8B=/models/q3``: a list of
            strings, because model names hold dots, which config keys cannot).
        state_dir: where checkpoints (``tinker://`` paths) are written.
        max_runs: training runs held at once (they share engines: ``engine.max_engines``); past it
            create_model is refused. Each run costs host memory for its adapters, their gradients
            and AdamW moments (about 4x its adapter size) while another run is resident.
        max_body_mb: the largest request body accepted.
        poll_timeout_s: how long a ``retrieve_future`` poll is held open before ``try_again``.
        session_timeout_s: a session with neither a heartbeat nor a request for this long is
            finished and its runs freed (the SDK heartbeats every 10 s while its client lives).
        max_sample_tokens: the most tokens one sample may generate (``max_tokens``; also bounded by
            the model's positions less the prompt).
        max_num_samples: the most sequences one sample request may ask for (``num_samples``).
        tenants: with two or more ``api_keys``, each key owns the sessions, runs, futures,
            samplers and checkpoints it creates, and another key finds none of them
            (``tinker_server.tenants``); false: every key reaches everything. The creating key's
            tag is recorded either way, so turning this on later separates what each key made.
        max_runs_per_key: training runs one API key holds at once (within ``max_runs``), so one
            key cannot take every run of the server.
        max_sampling_sessions_per_key: sampling sessions (``create_sampling_session``) one API key
            holds open at once; a session's are freed when its ServiceClient session finishes
            (snapshot samplers are bounded per run instead: ``snapshots_per_model``).
        snapshots_per_model: unnamed sampling snapshots (``save_weights_and_get_sampling_client``)
            one run keeps; past it the least recently used (sampled or scored longest ago) is
            freed, so a client that keeps using an early snapshot (a DPO reference, a teacher)
            keeps it while later ones come and go. Each holds a copy of the run's weights in host
            memory (LoRA adapters only with ``rollout.lora_rank``): the cap bounds that memory.
        ownerless_runs_owner: the API key (``tml-...``) or owner tag (``k-`` + 16 hex digits) that
            run records without an owner (``run.json`` of a server before issue 60) belong to;
            null: with tenants enforced such records belong to no key (left out of listings,
            refused by name), never to every key.
        log_level: the level of the ``tinker_server`` loggers when served (``python -m
            tinker_server``): ``info`` logs a line per run created and ended, ``debug`` also
            each call's timing.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    model_root: str | None = None
    aliases: list[str] = field(default_factory=list)
    state_dir: str = "outputs/tinker"
    max_runs: int = 16
    max_body_mb: float = 64.0
    poll_timeout_s: float = 30.0
    session_timeout_s: float = 60.0
    max_sample_tokens: int = 8192
    max_num_samples: int = 256
    tenants: bool = True
    max_runs_per_key: int = 8
    max_sampling_sessions_per_key: int = 256
    snapshots_per_model: int = 4
    ownerless_runs_owner: str | None = None
    log_level: str = "info"

    def _problems(self) -> list[str]:
        out = []
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                out.append(f"host = {self.host!r}: not an IP address; fix: 127.0.0.1 (this machine) or 0.0.0.0 (every interface)")
        if not 0 < self.port < 65536:
            out.append(f"port = {self.port}: not a TCP port; fix: e.g. 8000")
        malformed = [a for a in self.aliases if "=" not in a or not a.split("=", 1)[0] or not a.split("=", 1)[1]]
        if malformed:
            out.append(f"aliases = {malformed}: each must be NAME=DIR; fix: e.g. Qwen/Qwen3-8B=/models/qwen3-8b")
        bad = [k for k in self.api_keys if not str(k).startswith("tml-")]
        if bad:
            out.append(f"api_keys = {bad}: the tinker SDK only sends keys starting with 'tml-'; fix: e.g. tml-local")
        if self.model_root is None and not self.aliases:
            out.append("model_root = null and no aliases: no model would be served; fix: server.model_root=DIR of HF model directories")
        elif self.model_root is not None and not Path(self.model_root).is_dir():
            out.append(f"model_root = {self.model_root!r}: no such directory; fix: a directory of HF model directories")
        if self.max_runs < 1:
            out.append(f"max_runs = {self.max_runs}: must be >= 1; fix: e.g. 2")
        if not self.max_body_mb > 0:
            out.append(f"max_body_mb = {self.max_body_mb}: must be > 0; fix: e.g. 64")
        if not 20 <= self.session_timeout_s < float("inf"):
            out.append(f"session_timeout_s = {self.session_timeout_s}: must be >= 20 (the SDK heartbeats every 10 s); fix: e.g. 60")
        if self.max_sample_tokens < 1:
            out.append(f"max_sample_tokens = {self.max_sample_tokens}: must be >= 1; fix: e.g. 8192")
        if self.max_num_samples < 1:
            out.append(f"max_num_samples = {self.max_num_samples}: must be >= 1; fix: e.g. 256")
        if not self.poll_timeout_s > 0:
            out.append(f"poll_timeout_s = {self.poll_timeout_s}: must be > 0; fix: e.g. 30")
        if self.max_runs_per_key < 1:
            out.append(f"max_runs_per_key = {self.max_runs_per_key}: must be >= 1; fix: e.g. 8")
        if self.max_sampling_sessions_per_key < 1:
            out.append(f"max_sampling_sessions_per_key = {self.max_sampling_sessions_per_key}: must be >= 1; fix: e.g. 256")
        if self.snapshots_per_model < 1:
            out.append(f"snapshots_per_model = {self.snapshots_per_model}: must be >= 1; fix: e.g. 4")
        owner = self.ownerless_runs_owner
        if owner is not None:
            if not (owner.startswith("tml-") or tenants.TAG.fullmatch(owner)):
                out.append(
                    f"ownerless_runs_owner = {owner!r}: neither an API key (tml-...) nor an owner tag (k- and 16 hex digits); "
                    "fix: the key that older run records belong to, e.g. tml-local"
                )
            elif owner.startswith("tml-") and self.api_keys and owner not in self.api_keys:
                out.append("ownerless_runs_owner: that key is not one of api_keys, so nobody could reach those runs; fix: one of api_keys")
        if self.log_level.lower() not in LOG_LEVELS:
            out.append(f"log_level = {self.log_level!r}: not a level; fix: one of {', '.join(LOG_LEVELS)}")
        return out


@dataclass(frozen=True)
class EngineSection:
    """The engine of every training run.

    Attributes:
        strategy: ``engine.strategy`` (a backend that trains LoRA adapters: fsdp, or a plug-in).
        settings: further engine settings as ``key=value`` (e.g. ``max_token_len_per_micro_batch=4096``).
        ranks: data-parallel ranks of each run's engine; above 1 each run is a Ray worker group the
            server drives (the ``ray`` extra).
        cpus_per_rank: CPUs each of those workers reserves (fractions allowed).
        ray_address: null starts a local Ray instance; ``auto`` or ``HOST:PORT`` joins a cluster.
        share: runs on the same base model with the same LoRA rank, target modules and seed share
            one engine (the base weights once; each run's adapters and optimizer state swapped in
            for its calls; on Ray workers every rank swaps its shards); false: one engine per run.
        max_engines: engines held at once (one per base model and LoRA signature while shared);
            a create_model that needs one more is refused naming what is served.
    """

    strategy: str = "fsdp"
    settings: list[str] = field(default_factory=list)
    ranks: int = 1
    cpus_per_rank: float = 1.0
    ray_address: str | None = None
    share: bool = True
    max_engines: int = 2

    def _problems(self) -> list[str]:
        out = []
        bad = [s for s in self.settings if "=" not in s]
        if bad:
            out.append(f"settings = {bad}: each must be key=value; fix: e.g. micro_batch_size=4")
        if self.ranks < 1:
            out.append(f"ranks = {self.ranks}: must be >= 1; fix: 1 (in process) or more (Ray workers)")
        if not self.cpus_per_rank > 0:
            out.append(f"cpus_per_rank = {self.cpus_per_rank}: must be > 0; fix: e.g. 1")
        if self.max_engines < 1:
            out.append(f"max_engines = {self.max_engines}: must be >= 1; fix: e.g. 2")
        return out


@dataclass(frozen=True)
class RolloutSection:
    """The samplers.

    Attributes:
        backend: ``rollout.backend`` (hf or vllm).
        max_tokens: a sample's length when the request names none.
        lora_rank: > 0: a run's sampling snapshot (``save_weights_and_get_sampling_client``) is
            its LoRA adapter, served on the base weights by the rollout engine's LoRA (vllm:
            several resident, ``max_loras``), for runs of rank up to this; 0: merged weights.
        max_loras: adapters the rollout engine keeps resident (vllm's ``max_loras``; with
            ``lora_rank`` > 0); switching between them costs no reload.
    """

    backend: str = "hf"
    max_tokens: int = 64
    lora_rank: int = 0
    max_loras: int = 4

    def _problems(self) -> list[str]:
        out = [f"max_tokens = {self.max_tokens}: must be >= 1; fix: e.g. 64"] if self.max_tokens < 1 else []
        if self.lora_rank < 0:
            out.append(f"lora_rank = {self.lora_rank}: must be >= 0; fix: 0 (merged snapshots) or the largest run rank served")
        if self.max_loras < 1:
            out.append(f"max_loras = {self.max_loras}: must be >= 1; fix: e.g. 4")
        return out


@dataclass(frozen=True)
class TinkerSection:
    """How Tinker's requests map onto the engines.

    Attributes:
        lora_alpha: LoRA alpha of every run, whatever its rank (the update is ``alpha / rank * B A``).
    """

    lora_alpha: float = 32.0

    def _problems(self) -> list[str]:
        return [f"lora_alpha = {self.lora_alpha}: must be > 0; fix: e.g. 32"] if not self.lora_alpha > 0 else []


@dataclass(frozen=True)
class TinkerServerConfig:
    server: ServerSection = field(default_factory=ServerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    tinker: TinkerSection = field(default_factory=TinkerSection)

    def alias_table(self) -> dict[str, str]:
        """``server.aliases`` as a name -> directory table."""
        return dict(a.split("=", 1) for a in self.server.aliases)

    def server_settings(self) -> ServerSettings:
        s = self.server
        return ServerSettings(
            host=s.host,
            port=s.port,
            api_keys=tuple(s.api_keys),
            state_dir=Path(s.state_dir),
            max_runs=s.max_runs,
            max_body_bytes=int(s.max_body_mb * 2**20),
            poll_timeout_s=s.poll_timeout_s,
            session_timeout_s=s.session_timeout_s,
            max_sample_tokens=s.max_sample_tokens,
            max_num_samples=s.max_num_samples,
            tenants=s.tenants,
            max_runs_per_key=s.max_runs_per_key,
            max_sampling_sessions_per_key=s.max_sampling_sessions_per_key,
            snapshots_per_model=s.snapshots_per_model,
            ownerless_runs_owner=s.ownerless_runs_owner,
            log_level=s.log_level.lower(),
        )

    def run_settings(self) -> RunSettings:
        return RunSettings(
            strategy=self.engine.strategy,
            engine_overrides=tuple(self.engine.settings),
            rollout_backend=self.rollout.backend,
            rollout_lora_rank=self.rollout.lora_rank,
            rollout_max_loras=self.rollout.max_loras,
            lora_alpha=self.tinker.lora_alpha,
            max_tokens=self.rollout.max_tokens,
            ranks=self.engine.ranks,
            cpus_per_rank=self.engine.cpus_per_rank,
            ray_address=self.engine.ray_address,
            share=self.engine.share,
            max_engines=self.engine.max_engines,
        )


def load_server_config(path: str | None, overrides: list[str] = ()) -> TinkerServerConfig:
    """The config of ``path`` (YAML) with dot-list ``overrides``; raises ``ValueError`` listing every problem."""
    from engine_api.typed_config import load_typed

    return load_typed(TinkerServerConfig, path, list(overrides))
