"""The training side's entry point (``contract.RunFactory``): the served base models, the engines
held (``engines.RunEngine``: in process, or Ray worker groups at ``engine.ranks > 1``), which
engine a new run joins, and the rollout engines that serve the samplers.

Everything a run needs is checked when the factory is built (the backend trains LoRA, the engine
settings load, the rollout backend serves adapters when asked to), so a bad setting stops the
server at start instead of failing each ``create_model``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinker_server.config import RunSettings
from tinker_server.contract import ChatModel, LoraIn, TrainingRun, UserError
from tinker_server.engines import RunEngine
from tinker_server.ray_engine import RayEngine
from tinker_server.shared_engine import SharedEngine
from tinker_server.signature import run_seed, signature
from tinker_server.snapshots import RolloutPool, Snapshot


def _check_settings(settings: RunSettings) -> None:
    """Refuse, naming the key and the fix, what no run could be served with."""
    from engine_api import load_config
    from engine_api.registry import get_engine_class

    if not get_engine_class(settings.strategy).supports_lora:
        # Every Tinker run is a LoRA run: refused at start, not at the first create_model.
        raise ValueError(
            f"engine.strategy = {settings.strategy!r}: that backend trains no LoRA adapters, and every Tinker training run "
            "is a LoRA run; fix: engine.strategy=fsdp or megatron (or a plug-in backend with supports_lora)"
        )
    if settings.rollout_lora_rank:
        from engine_api.rollout_registry import get_rollout_class

        if not get_rollout_class(settings.rollout_backend).supports_lora:
            raise ValueError(
                f"rollout.lora_rank = {settings.rollout_lora_rank}: the {settings.rollout_backend!r} rollout backend serves no "
                "LoRA adapters; fix: rollout.backend=vllm, or rollout.lora_rank=0 (merged snapshots)"
            )
    try:  # every engine setting checked now, not at the first create_model
        load_config(None, [f"strategy={settings.strategy}", *settings.engine_overrides])
    except ValueError as exc:
        raise ValueError(f"engine.settings = {list(settings.engine_overrides)}: {exc}") from None


class EngineFactory:
    """``contract.RunFactory``: base models are the HF directories under ``model_root`` (by
    directory name) and the ``aliases`` (name -> directory).

    Raises:
        ValueError: a setting no run could be served with, or an alias that is not an HF model
            directory (named, with the fix).
    """

    def __init__(self, model_root: str | None, aliases: dict[str, str], settings: RunSettings) -> None:
        _check_settings(settings)
        self.models: dict[str, str] = {}
        if model_root and Path(model_root).is_dir():
            for child in sorted(Path(model_root).iterdir()):
                if (child / "config.json").exists():
                    self.models[child.name] = str(child)
        for name, path in aliases.items():
            if not (Path(path) / "config.json").exists():
                raise ValueError(f"server.aliases[{name!r}] = {path!r}: not an HF model directory (no config.json); fix: point it at one")
            self.models[name] = str(path)
        self.settings = settings
        self.pools: dict[str, RolloutPool] = {}
        #: every run built, in order (tests reach a served run's engine through it)
        self.created: list[TrainingRun] = []
        self.engines: list[RunEngine] = []  # the engines held (in process, or Ray worker groups)
        self.chats: dict[str, ChatModel] = {}

    def served_models(self) -> list[str]:
        """The base model names this server trains and samples."""
        return sorted(self.models)

    def chat_model(self, base_model: str) -> ChatModel:
        """``contract.RunFactory.chat_model``: the tokenizer of ``base_model``'s directory (loaded
        once; no remote code), its stop ids (``posttrain.data.tokenizer.stop_token_ids``) and the
        tool-call format its chat template writes (``posttrain.agents.tools.detect_format``)."""
        if base_model not in self.chats:
            from transformers import AutoTokenizer

            from posttrain.agents.tools import detect_format
            from posttrain.data.tokenizer import stop_token_ids

            model_dir = self._dir(base_model)
            try:
                tok = AutoTokenizer.from_pretrained(model_dir)
            except Exception as exc:  # noqa: BLE001 - a directory without a tokenizer: the client's request cannot be served
                raise UserError(
                    f"model = {base_model!r} has no tokenizer here ({type(exc).__name__}); fix: sample it with token ids"
                ) from None
            template = getattr(tok, "chat_template", None)
            self.chats[base_model] = ChatModel(tok, tuple(stop_token_ids(tok, model_dir)), detect_format(template) if template else None)
        return self.chats[base_model]

    def _dir(self, base_model: str) -> str:
        if base_model not in self.models:
            raise UserError(f"base_model = {base_model!r} is not served here; fix: one of {self.served_models()}")
        return self.models[base_model]

    def _pool(self, base_model: str) -> RolloutPool:
        if base_model not in self.pools:
            self.pools[base_model] = RolloutPool(self._dir(base_model), self.settings)
        return self.pools[base_model]

    def _engine_for(self, base_model: str, model_dir: str, lora: LoraIn) -> RunEngine:
        """The engine a run of ``lora`` joins: the held one of its signature when ``share`` is on
        (and it serves the run's seed), else a new one (refused past ``max_engines``)."""
        sig = signature(base_model, model_dir, lora)
        self.engines = [e for e in self.engines if not e.closed]  # closed ones leave
        seed = run_seed(lora)
        fits = [e for e in self.engines if e.signature == sig and (e.can_reseed or e.seed == seed)]
        if fits and self.settings.share:
            return fits[0]
        if len(self.engines) >= self.settings.max_engines:
            served = sorted({e.signature.describe() for e in self.engines})
            raise UserError(
                f"create_model: {sig.describe()} needs an engine of its own and the server holds engine.max_engines = "
                f"{self.settings.max_engines} ({'; '.join(served)}); fix: create the run with the rank and toggles of a "
                "served engine, unload the runs of one, or start the server with a larger engine.max_engines"
            )
        engine: RunEngine
        if self.settings.ranks > 1:
            engine = RayEngine(sig, model_dir, self.settings)
        else:
            engine = SharedEngine(sig, seed, model_dir, self.settings)
        self.engines.append(engine)
        return engine

    def create_run(self, base_model: str, lora: LoraIn) -> TrainingRun:
        """A run of ``lora`` on ``base_model``, opened by the engine of its signature
        (:meth:`_engine_for`)."""
        engine = self._engine_for(base_model, self._dir(base_model), lora)
        run = engine.open_run(base_model, lora, self._pool(base_model))
        self.created.append(run)
        return run

    def base_sampler(self, base_model: str) -> Snapshot:
        """A sampler of the base model itself."""
        return Snapshot(self._pool(base_model), None)

    def load_sampler(self, directory: Path) -> Snapshot:
        """A snapshot saved by a run's named ``sampler`` (weights and its base model's name; JSON
        and safetensors only: nothing in the directory is executed or unpickled)."""
        from safetensors.torch import load_file

        path, meta = directory / "model.safetensors", directory / "sampler.json"
        if not path.exists() or not meta.exists():
            raise UserError(f"model_path: {directory.name!r} holds no sampler weights; fix: a path from save_weights_for_sampler")
        damaged = f"model_path: the sampler checkpoint {directory.name!r} is damaged"
        try:
            base_model = json.loads(meta.read_text()).get("base_model")
            weights = load_file(str(path))
        except Exception as exc:  # noqa: BLE001 - a file changed on disk: JSON, safetensors or I/O errors alike
            raise UserError(f"{damaged} ({type(exc).__name__}: {exc}); fix: save it again with save_weights_for_sampler") from None
        if base_model not in self.models:
            raise UserError(f"{damaged}: its sampler.json names base model {base_model!r}, not one served here; fix: save it again")
        pool = self._pool(base_model)
        common = sorted(set(weights) & set(pool.base))
        wrong = [k for k in common if weights[k].shape != pool.base[k].shape]
        if not common or wrong:
            shown = wrong[0] if wrong else "no tensor of the base model's names"
            raise UserError(f"{damaged}: its tensors do not match {base_model}'s ({shown}); fix: save it again")
        return Snapshot(pool, weights)

    def close(self) -> None:
        """Shut the rollout engines down (and the local Ray instance the first Ray run started)."""
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        if self.settings.ranks > 1 and self.settings.ray_address is None:
            import ray

            if ray.is_initialized():
                ray.shutdown()  # the local instance the first run started
