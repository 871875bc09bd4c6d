"""The multi-turn rollout: every trajectory of a step advanced turn by turn through the rollout
role, the environment answering each turn, the whole kept token in, token out
(``posttrain.agents.trajectory``), and the step's protocol batch built from the result.

One step (``AgentLoop.run``): each trajectory starts from its prompt rendered with its tools;
turn ``t`` samples every unfinished trajectory's next assistant turn in one rollout call per
distinct length cap (``min(rollout.max_new_tokens, env.max_tokens - tokens so far)``), seeded
``sample_seed(seed of the trajectory, t)``; the environment answers each turn; a trajectory
ends when the environment says done, at ``env.max_turns``, or at the token budget (flagged
truncated). Its reward: the environment's rewards (``env.turn_rewards``) plus
``reward.function``'s score of the final answer when set.

Ranks: the environment, the tools, the template and the reward function run on rank 0 only
(user code with side effects runs once); each turn's prompts, and at the end the training
samples, reach the other ranks by one broadcast, and every rank calls the rollout role with the
same prompts (it is collective). An error on rank 0 is broadcast too, so every rank stops.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import numbers
import statistics
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from engine_api.dist import comm_device, is_initialized
from engine_api.rollout import Sample, sample_seed
from posttrain.agents.config import EnvConfig
from posttrain.agents.env import StepResult, ToolEnv, Turn
from posttrain.agents.scheduler import CallScheduler, RoundFailed
from posttrain.agents.tool_runner import Tool, ToolRunner
from posttrain.agents.tools import ToolCall, check_declared_tools, detect_format, parse_tool_calls, schema_name, tool_schema
from posttrain.agents.trajectory import HistoryMismatch, Trajectory, bound_messages, message_list
from posttrain.async_rl.producer import ScoredBatch, check_sample
from posttrain.fencing import FencedTimeout, UserCodeError, fenced, load_callable, user_frame
from posttrain.rewards import as_reward, compute_rewards
from posttrain.trainer_utils import warn
from roles.rollout import pack_samples, rl_batch, unpack_samples

# How a paused trajectory's digest is computed (``_digest``): 2 covers log-probs and versions.
DIGEST_VERSION = 2


@dataclass
class AgentRun:
    """One batch's trajectories in progress: what ``AgentLoop.advance`` continues (the
    asynchronous pipeline pauses it between turns, across weight updates).

    Attributes:
        metas: one prompt row per trajectory.
        seeds: each trajectory's seed.
        turn: the next assistant turn's index (every unfinished trajectory is at it).
        finished: every trajectory has ended.
        trajs, envs: the trajectories and their environments (rank 0; None elsewhere).
        record: per trajectory the samples of its turns in order (rank 0): with the rows, all a
            checkpoint needs to rebuild the rest (``AgentLoop.replay``).
        scored: the finished batch, once every trajectory has ended and been scored.
        digests: per trajectory a SHA-256 of its state when saved (set by ``from_tensors``).
        digest_version: how ``digests`` were computed (``_digest``).
    """

    metas: list
    seeds: list[int]
    turn: int = 0
    finished: bool = False
    trajs: list[Trajectory] | None = None
    envs: list | None = None
    record: list[list[Sample]] | None = None
    digests: list[str] = field(default_factory=list)
    digest_version: int = DIGEST_VERSION
    scored: ScoredBatch | None = None

    def to_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``(tensors, meta)`` of a paused run (rank 0; tensors and JSON only, nothing pickled):
        its kept samples, which trajectory each belongs to, and each trajectory's digest."""
        flat = [s for kept in self.record for s in kept]
        owner = torch.tensor([i for i, kept in enumerate(self.record) for _ in kept], dtype=torch.long)
        meta = {"turn": self.turn, "finished": self.finished, "seeds": self.seeds, "digests": [_digest(t) for t in self.trajs]}
        meta["digest_version"] = DIGEST_VERSION
        return {"owner": owner, **pack_samples(flat)}, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any], max_version: int | None = None) -> AgentRun:
        """The saved run (no trajectories or environments yet: ``AgentLoop.replay`` rebuilds them).
        ``max_version``: the newest weight version that can have sampled it (the checkpoint's
        step); its samples' versions and log-probs are checked against it.

        Raises:
            ValueError: the tensors do not describe one sample per kept turn, or hold weight
                versions or log-probs out of range.
        """
        seeds = [int(s) for s in meta["seeds"]]
        flat = unpack_samples({k: v for k, v in tensors.items() if k != "owner"})
        owner = tensors["owner"].tolist()
        if len(owner) != len(flat) or any(s is None for s in flat) or any(not 0 <= i < len(seeds) for i in owner):
            raise ValueError(f"a paused multi-turn run: {len(flat)} samples for {len(owner)} owners of {len(seeds)} trajectories")
        record: list[list[Sample]] = [[] for _ in seeds]
        for i, s in zip(owner, flat, strict=True):
            record[i].append(s)
        digests = [str(d) for d in meta["digests"]]
        if len(digests) != len(seeds) or any(len(kept) > int(meta["turn"]) for kept in record):
            raise ValueError(f"a paused multi-turn run at turn {meta['turn']}: {len(digests)} digests for {len(seeds)} trajectories")
        for s in flat:
            check_sample(s, max_version, "a paused multi-turn run")
        version = int(meta.get("digest_version", 1))
        return cls([], seeds, int(meta["turn"]), bool(meta["finished"]), record=record, digests=digests, digest_version=version)


class AgentLoop:
    """Multi-turn rollouts of one run (module docstring).

    Args:
        env: the ``env`` section.
        tokenizer: the model directory's tokenizer (its chat template renders every turn).
        template_kwargs: ``data.chat_template_kwargs``.
        stop_ids: the rollout's stop token ids.
        temperature: the rollout temperature (batch metadata).
        reward: ``(fn, spec, batched, timeout_s)`` of ``reward.function``, or None.
    """

    def __init__(
        self,
        env: EnvConfig,
        tokenizer,
        template_kwargs: Mapping[str, Any],
        stop_ids: Sequence[int],
        temperature: float,
        reward: tuple[Callable, str, bool, float | None] | None,
    ) -> None:
        self.cfg, self.tok, self.kwargs = env, tokenizer, dict(template_kwargs)
        self.stop_ids, self.temperature, self.reward = list(stop_ids), temperature, reward
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "env.function: multi-turn rollouts render every turn with the tokenizer's chat template, and it has none; fix: "
                "save a chat template with the tokenizer (engine.model.path)"
            )
        self.rank0 = not is_initialized() or dist.get_rank() == 0
        self.factory: Callable | None = None
        self.tools: dict[str, Tool] = {}
        self.runner: ToolRunner | None = None
        self.max_observation_chars = 0
        self._lock = threading.Lock()
        if self.rank0:  # user code: loaded where it runs
            self.factory, self.tools = load_env_code(env)
            self.runner = ToolRunner(
                env.tool_timeout_s, env.tool_concurrency, env.tool_turn_timeout_s, env.tool_isolation, env.max_abandoned_tools
            )
            self.max_observation_chars = env.max_observation_chars or 2 * env.max_tokens * _longest_token(tokenizer)
        fmt = env.tool_format
        if fmt == "auto":
            fmt = detect_format(tokenizer.chat_template)
            if fmt is None and (env.tools or env.function == "tools"):
                raise ValueError(
                    "env.tool_format = 'auto': the chat template shows neither the hermes (<tool_call>) nor the llama3 "
                    "(<|python_tag|>) tool-call form; fix: env.tool_format=hermes or llama3, the form your model was trained on"
                )
        self.fmt = fmt

    def close(self) -> None:
        """Stop the tool worker processes (they also stop at interpreter exit)."""
        if self.runner is not None:
            self.runner.close()

    def settings(self) -> dict[str, Any]:
        """The ``env`` settings a trajectory depends on (what a checkpointed batch was made
        with: the asynchronous pipeline regenerates one made with other values, naming them)."""
        keys = ("function", "tools", "tool_format", "max_turns", "max_tokens", "history_mismatch", "turn_rewards")
        keys += ("observation_role", "max_observation_chars", "observation_overflow")
        return {f"env.{k}": _jsonable(getattr(self.cfg, k)) for k in keys}

    # ------------------------------------------------------------------ one step
    def run(self, rollout, metas: Sequence, seeds: Sequence[int], max_new_tokens: int, state: AgentRun | None = None) -> ScoredBatch:
        """The trajectories of ``metas`` (``posttrain.text_data.PromptSample``, one per
        trajectory: a GRPO group's prompt repeated), trajectory ``i`` seeded ``seeds[i]``, every
        turn left run now (``state``: a run already advanced by ``advance``). Collective over
        the ranks."""
        state = self.start(metas, seeds) if state is None else state
        self.advance(rollout, state, max_new_tokens)
        return self.finish(state)

    def start(self, metas: Sequence, seeds: Sequence[int]) -> AgentRun:
        """A run of ``metas``'s trajectories with no turn sampled yet (the prompts rendered, the
        environments built). Collective."""
        run = AgentRun(list(metas), [int(s) for s in seeds])

        def start() -> None:
            run.trajs, run.envs = self._start(run.metas)
            run.record = [[] for _ in run.metas]

        _on_rank0(start)
        return run

    def advance(self, rollout, run: AgentRun, max_new_tokens: int, turns: int | None = None) -> None:
        """Sample up to ``turns`` more assistant turns of every unfinished trajectory of ``run``
        (None: until every trajectory has ended), each answered by its environment. Each
        trajectory runs on its own (a thread on rank 0) and asks for its next turn as soon as its
        environment and tools have answered; the rollout serves every waiting call together
        (``posttrain.agents.scheduler``), so no trajectory waits for another's tools. Turn ``t``'s
        sample is seeded ``sample_seed(seed, t)`` whenever it runs, so a run paused between turns
        (the asynchronous pipeline's weight updates) samples what an unpaused one would under the
        same weights. Collective."""
        stop = self.cfg.max_turns if turns is None else min(self.cfg.max_turns, run.turn + turns)
        if not run.finished and run.turn < stop:
            scheduler = CallScheduler(rollout, lockstep=self.cfg.schedule == "lockstep")
            if self.rank0:
                self._run_round(scheduler, run, stop - run.turn, max_new_tokens)
            else:
                scheduler.follow()
            ended = _on_rank0(lambda: all(t.done for t in run.trajs))
            run.turn, run.finished = stop, ended
        run.finished = run.finished or run.turn >= self.cfg.max_turns

    def _run_round(self, scheduler: CallScheduler, run: AgentRun, allowance: int, max_new_tokens: int) -> None:
        """Rank 0: a thread per unfinished trajectory, each taking up to ``allowance`` turns,
        served by ``scheduler`` until all have stopped; the first failure stops every rank."""
        live = [i for i, t in enumerate(run.trajs) if not t.done]
        scheduler.started(len(live))
        threads = [
            threading.Thread(target=self._trajectory, args=(scheduler, run, i, allowance, max_new_tokens), daemon=True) for i in live
        ]
        for thread in threads:
            thread.start()
        try:
            scheduler.serve()
        finally:
            for thread in threads:
                thread.join()

    def _trajectory(self, scheduler: CallScheduler, run: AgentRun, i: int, allowance: int, max_new_tokens: int) -> None:
        """One trajectory's turns of a round (a thread): sample, keep, answer; a failure is handed
        to the scheduler, which stops the round."""
        t = run.trajs[i]
        try:
            for _ in range(allowance):
                amount = t.next_turn_tokens(max_new_tokens)
                if amount is None:
                    break
                turn = t.turns
                sample = scheduler.sample(list(t.current.ids), sample_seed(run.seeds[i], turn), amount, order=(i,))
                with self._lock:  # the tokenizer and template are shared by every trajectory's thread
                    t.add_turn(sample)
                run.record[i].append(sample)
                self._respond_one(run.trajs, run.envs, run.metas, i, turn)
        except RoundFailed:
            pass  # another trajectory or the rollout failed: the scheduler raises that
        except BaseException as exc:  # noqa: BLE001 (an environment's error: stops the run, on every rank)
            scheduler.fail(exc)
        finally:
            scheduler.ended()

    def replay(self, saved: AgentRun, metas: Sequence) -> AgentRun | None:
        """A run paused by a checkpoint (``AgentRun.from_tensors``), live again: its prompts
        rendered and environments built anew, and each kept turn's sampled tokens given back to
        them in order, as ``advance`` did; nothing is sampled. Assumption (docs/agents.md): an
        environment (and its tools) answers the same turns the same way. Each trajectory's state
        is checked against the digest saved with it; None (warned on rank 0) when one differs: the
        batch is then generated again from its first turn, never trained twice. Collective."""
        run = self.start(metas, saved.seeds)
        run.turn, run.finished = saved.turn, saved.finished

        def replay() -> str | None:
            for turn in range(saved.turn):
                plan = self._plan(run.trajs, 1 << 30)
                rows = sorted(i for _, group in plan.items() for i, _ in group)
                want = sorted(i for i, kept in enumerate(saved.record) if len(kept) > turn)
                if rows != want:
                    return f"turn {turn}: trajectories {rows} go on, the checkpoint sampled {want}"
                for i in rows:
                    run.trajs[i].add_turn(saved.record[i][turn])
                    run.record[i].append(saved.record[i][turn])
                    self._respond_one(run.trajs, run.envs, run.metas, i, turn)
            for i, (t, digest) in enumerate(zip(run.trajs, saved.digests, strict=True)):
                if _digest(t, saved.digest_version) != digest:
                    return f"trajectory {i} (row {run.metas[i].source}) differs after its {len(saved.record[i])} kept turn(s)"
            return None

        why = _on_rank0(replay)
        if why is None:
            return run
        warn(
            [
                f"trainer.resume: a batch of trajectories paused at a checkpoint (turn {saved.turn}) does not replay: {why}; the "
                f"environment (env.function = {self.cfg.function!r}) does not answer the kept turns as it did, so the batch is "
                "generated again from its first turn with the resumed weights (trained once; the run differs from an "
                "uninterrupted one); fix: make the environment and its tools deterministic given the row and the turns"
            ],
            self.rank0,
        )
        return None

    def finish(self, run: AgentRun) -> ScoredBatch:
        """The training batch of a run whose trajectories have all ended. Collective."""
        if not run.finished:
            raise RuntimeError(f"AgentLoop.finish: the run is at turn {run.turn} with trajectories unfinished")
        trajs, envs, metas = run.trajs, run.envs, run.metas
        rows = _on_rank0(lambda: self._rows(trajs))
        scores = self._scores(trajs, envs, metas, len(metas))
        texts = []
        if self.rank0:
            texts = [
                {"prompt": m.text, "response": t.text[len(m.text) :] if t.text.startswith(m.text) else t.text, "reward": float(r)}
                for m, t, r in zip(metas, trajs, scores.tolist(), strict=True)
            ]
        return scored_batch(rows, scores, self.temperature, texts)

    # ------------------------------------------------------------------ rank 0's parts
    def _start(self, metas: Sequence) -> tuple[list[Trajectory], list]:
        trajs, envs = [], []
        for m in metas:
            declared = check_declared_tools(m.columns.get("tools"), m.source)
            env = self._build_env(m)
            registry = dict(self.tools)
            for fn in getattr(env, "tools", None) or []:  # Python objects: run in threads (tool_runner)
                name = getattr(fn, "__name__", str(fn))
                registry[name] = Tool(name, fn)
            by_name = {schema_name(d): d for d in declared}
            schemas = [tool_schema(tool.fn, by_name) for tool in registry.values()]
            schemas += [d for name, d in by_name.items() if name not in registry]
            messages = list(m.messages) if getattr(m, "messages", None) else [{"role": "user", "content": m.text}]
            render = _renderer(self.tok, schemas or None, self.kwargs)
            try:
                text = render(messages)
                ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            except Exception as exc:  # noqa: BLE001 (a template's or tokenizer's own error, named below)
                raise ValueError(
                    f"row {m.source}: the chat template could not render the prompt with its tools ({type(exc).__name__}: {exc}); "
                    "fix: check the row's messages and tools column against the model's chat template"
                ) from exc
            if len(ids) >= self.cfg.max_tokens:
                raise ValueError(
                    f"row {m.source}: its prompt (tools included) has {len(ids)} tokens, not below env.max_tokens = "
                    f"{self.cfg.max_tokens}; fix: raise env.max_tokens or shorten the prompt"
                )
            t = Trajectory(messages, ids, text, self.tok, render, self.cfg.max_tokens, self.stop_ids, self.cfg.history_mismatch)
            # The loop runs the environment's tool calls: the built-in tool environment's always
            # (an unknown tool is an error observation), another's when it offers tools.
            t.tools = registry if isinstance(env, ToolEnv) or registry else None
            trajs.append(t)
            envs.append(env)
        return trajs, envs

    def _build_env(self, meta):
        columns = copy.deepcopy(dict(meta.columns))  # its own row: changes reach no other trajectory, reward or epoch
        if self.factory is None:
            return ToolEnv(meta.text, **columns)
        return self._fence(lambda: self.factory(meta.text, **columns), meta.source, "building the environment")

    def _plan(self, trajs: list[Trajectory], max_new_tokens: int) -> dict[int, list[tuple[int, list[int]]]]:
        plan: dict[int, list[tuple[int, list[int]]]] = {}
        for i, t in enumerate(trajs):
            amount = t.next_turn_tokens(max_new_tokens)
            if amount is not None:
                plan.setdefault(amount, []).append((i, list(t.current.ids)))
        return plan

    def _respond_one(self, trajs, envs, metas, i: int, turn: int) -> None:
        """Trajectory ``i``'s answer to its assistant turn ``turn``: its tool calls run (when the
        loop runs its environment's tools), its environment's ``step``, the observation kept."""
        t, m = trajs[i], metas[i]
        calls = parse_tool_calls(t.last_text, self.fmt) if self.fmt else []
        results = self._run_tools(t, calls)
        step = Turn(turn, t.last_text, calls, t.last_finish == "length", results)
        result = self._fence(lambda env=envs[i], step=step: env.step(step), m.source, f"turn {turn}")
        result = _check_result(result, self.cfg.function, m.source)
        t.rewards.append(float(as_reward(result.reward)))
        t.calls += len(calls)
        t.errors += int(result.tool_errors) + sum(r.error for r in results)
        t.cut_observations += any(r.truncated for r in results)
        if result.done or turn + 1 >= self.cfg.max_turns or t.truncated:
            t.done = True
            return
        observation = message_list(result.observation, self.cfg.observation_role, m.source, str(self.cfg.function))
        if observation is None:
            raise ValueError(
                f"env.function = {self.cfg.function!r} (row {m.source}), turn {turn}: no observation but not done; fix: "
                "return an observation, or done=True"
            )
        with self._lock:
            if not self._observe(t, observation, m.source, turn):
                t.done = True

    def _run_tools(self, t: Trajectory, calls: list[ToolCall]) -> list:
        """A turn's tool calls, run at once (the loop runs the environment's tools), or none."""
        if t.tools is None or not calls:
            return []
        return self.runner.run([(c, t.tools) for c in calls], [self.max_observation_chars] * len(calls))

    def _observe(self, t: Trajectory, observation: list[dict], source: str, turn: int) -> bool:
        """Append an observation to ``t`` (bounded by ``env.max_observation_chars`` before the
        template runs); False: the budget ended the trajectory. Errors name the row and turn."""
        name, limit = self.cfg.function, self.max_observation_chars
        for k, message in enumerate(observation):
            try:
                message["content"].encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"env.function = {name!r} (row {source}), turn {turn}: observation message {k} holds {exc.object[exc.start]!r} "
                    f"at character {exc.start}, which is not valid Unicode text (a lone surrogate); fix: return valid text (e.g. "
                    "decode bytes with errors='replace')"
                ) from None
        observation, cut = bound_messages(observation, limit)
        if cut:
            if self.cfg.observation_overflow == "error":
                raise ValueError(
                    f"env.function = {name!r} (row {source}), turn {turn}: the observation has more than env.max_observation_chars "
                    f"= {limit} characters; fix: return less, raise env.max_observation_chars, or env.observation_overflow=truncate"
                )
            t.cut_observations += 1
        try:
            return t.add_observation(observation)
        except HistoryMismatch as exc:
            raise HistoryMismatch(f"env.function = {name!r} (row {source}): {exc}") from None
        except Exception as exc:  # noqa: BLE001 (the template's or the tokenizer's own error, named here)
            roles = sorted({str(mm.get("role")) for mm in observation})
            raise ValueError(
                f"env.function = {name!r} (row {source}), turn {turn}: the chat template or tokenizer could not take the observation "
                f"(roles {roles}): {type(exc).__name__}: {exc}; fix: an observation role the template knows "
                "(env.observation_role, e.g. user) and plain text content"
            ) from exc

    def _fence(self, fn: Callable[[], Any], source: str, what: str) -> Any:
        name = self.cfg.function
        try:
            return fenced(fn, self.cfg.step_timeout_s)
        except KeyboardInterrupt:
            raise
        except FencedTimeout:
            raise UserCodeError(
                f"env.function = {name!r} (row {source}), {what}: did not return within env.step_timeout_s = {self.cfg.step_timeout_s:g} s "
                "(abandoned: a thread cannot be stopped); fix: make it faster, or raise env.step_timeout_s"
            ) from None
        except BaseException as exc:  # noqa: BLE001 (user code: sys.exit included)
            raise UserCodeError(
                f"env.function = {name!r} (row {source}), {what}: raised {exc!r}; no update was made", user_frame(exc)
            ) from exc

    def _rows(self, trajs: list[Trajectory]):
        return trajectory_rows(trajs)

    def _scores(self, trajs, envs, metas, count: int) -> torch.Tensor:
        env_scores = torch.zeros(count, dtype=torch.float64)
        if self.rank0:
            combine = sum if self.cfg.turn_rewards == "sum" else (lambda r: r[-1] if r else 0.0)
            env_scores = torch.tensor([float(combine(t.rewards)) for t in trajs], dtype=torch.float64)
        if is_initialized() and dist.get_world_size() > 1:
            env_scores = env_scores.to(comm_device(None))
            dist.broadcast(env_scores, src=0)
            env_scores = env_scores.cpu()
        if self.reward is None:
            return env_scores
        fn, spec, batched, timeout_s = self.reward
        if self.rank0:
            prompts, responses = [m.text for m in metas], [t.last_answer for t in trajs]
            columns, sources = [copy.deepcopy(dict(m.columns)) for m in metas], [m.source for m in metas]
        else:  # only rank 0 calls the function; the others take part in its one collective
            prompts = responses = [""] * count
            columns, sources = [{}] * count, [""] * count
        return env_scores + compute_rewards(fn, batched, prompts, responses, columns, sources, name=spec, timeout_s=timeout_s)


_DTYPES = {
    "ids": torch.long,
    "loss_mask": torch.float32,
    "rollout_log_probs": torch.float32,
    "rollout_token_versions": torch.long,
    "turns": torch.long,
}


def _renderer(tokenizer, tools: list[dict] | None, kwargs: Mapping[str, Any]):
    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs)

    return render


def _check_result(result: object, name: object, source: str) -> StepResult:
    """An environment's ``step`` result as a checked ``StepResult`` (a 3-tuple is accepted)."""
    if isinstance(result, tuple) and len(result) == 3:
        result = StepResult(*result)
    if not isinstance(result, StepResult):
        raise ValueError(
            f"env.function = {name!r} (row {source}): step returned a {type(result).__name__}; fix: return "
            "posttrain.agents.StepResult(observation, reward, done) or an (observation, reward, done) tuple"
        )
    if as_reward(result.reward) is None or not math.isfinite(as_reward(result.reward)):
        raise ValueError(f"env.function = {name!r} (row {source}): reward {result.reward!r} is not a finite number; fix: return a float")
    if not isinstance(result.done, bool):
        raise ValueError(f"env.function = {name!r} (row {source}): done = {result.done!r} is not a bool; fix: True or False")
    errors = result.tool_errors
    if isinstance(errors, bool) or not isinstance(errors, numbers.Integral) or errors < 0:
        raise ValueError(
            f"env.function = {name!r} (row {source}): tool_errors = {errors!r} is not an integer >= 0; fix: the number of error "
            "observations the environment put in this turn's observation (0 when none)"
        )
    return result


def scored_batch(rows, scores: torch.Tensor, temperature: float, texts: list, groups: torch.Tensor | None = None) -> ScoredBatch:
    """The ``ScoredBatch`` of :func:`trajectory_rows`' ``rows`` and each trajectory's score
    (``groups``: each trajectory's GRPO group, when not ``index // n_samples``)."""
    segments, traj_of_row, prompt_lens, truncated, metrics, routing = rows
    fields = {k: [torch.tensor(v, dtype=d) for v in segments[k]] for k, d in _DTYPES.items()}
    batch = rl_batch(
        fields["ids"],
        fields["loss_mask"],
        fields["rollout_log_probs"],
        fields["rollout_token_versions"],
        torch.tensor(prompt_lens, dtype=torch.long),
        torch.tensor(truncated, dtype=torch.long),
        temperature,
        routing or None,
    )
    traj = torch.tensor(traj_of_row, dtype=torch.long)
    return ScoredBatch(batch, scores, traj, torch.cat(fields["turns"]), metrics, texts, groups=groups)


def trajectory_rows(trajs: list[Trajectory]):
    """The training rows of ``trajs`` (every segment holding a sampled token: ids, loss mask,
    sampling log-probs, versions, turn of each token), the trajectory, prompt length and
    truncation of each row, the ``env/*`` metrics and the recorded routing (empty when none)."""
    segments = {k: [] for k in _DTYPES}
    traj_of_row, prompt_lens, truncated, routing = [], [], [], []
    for i, t in enumerate(trajs):
        for s in t.segments():
            routed = s.routed_experts()
            if routed is not None:
                routing.append(routed)
            columns = {"ids": s.ids, "loss_mask": s.mask, "rollout_log_probs": s.log_probs, "rollout_token_versions": s.versions}
            for k, v in {**columns, "turns": s.turns}.items():
                segments[k].append(list(v))
            traj_of_row.append(i)
            prompt_lens.append(s.prompt_len)
            truncated.append(int(t.truncated))
    turns = [t.turns for t in trajs]
    metrics = {
        "env/turns_mean": statistics.mean(turns),
        "env/turns_max": float(max(turns)),
        "env/tool_calls_mean": statistics.mean(t.calls for t in trajs),
        "env/tool_errors_sum": float(sum(t.errors for t in trajs)),
        "env/observations_truncated": float(sum(t.cut_observations for t in trajs)),
        "env/truncated_frac": statistics.mean(float(t.truncated) for t in trajs),
        "env/split_frac": statistics.mean(float(t.splits > 0) for t in trajs),
    }
    if routing and len(routing) != len(traj_of_row):
        raise RuntimeError("the rollout recorded MoE routing for some trajectories' samples and not others")
    return segments, traj_of_row, prompt_lens, truncated, metrics, routing


def _digest(t: Trajectory, version: int = DIGEST_VERSION) -> str:
    """A trajectory's state (its tokens, their sampling log-probs and weight versions, what the
    environment gave, whether it ended) as a SHA-256: what a replay must reproduce. Version 1
    (paused runs saved before the log-probs and versions were covered) hashes tokens and flags only."""
    segments = [[s.ids, s.prompt_len, s.mask] + ([s.log_probs, s.versions] if version >= 2 else []) for s in (*t.closed, t.current)]
    state = {"segments": segments, "rewards": t.rewards, "flags": [t.turns, t.calls, t.errors, t.done, t.truncated, t.splits]}
    return hashlib.sha256(json.dumps(state).encode()).hexdigest()


def _longest_token(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for, from its vocabulary's strings
    (a byte-level token's string has a character per byte, so never fewer than it decodes to)."""
    return max(8, max((len(t) for t in tokenizer.get_vocab()), default=8))


def _jsonable(value: object) -> object:
    return list(value) if isinstance(value, (list, tuple)) else value


def load_env_code(env: EnvConfig) -> tuple[Callable | None, dict[str, Tool]]:
    """``env.function``'s callable (None for the built-in ``tools``) and ``env.tools``'s tools,
    imported and checked (each tool's schema built). Called when the loop is built, and by the
    recipe at config load so a misspelt name fails before the data and the engines.

    Raises:
        ValueError: naming the key, the spec and the fix.
    """
    tools = {}
    for spec in env.tools:
        fn = load_callable(spec, "env.tools")
        tool_schema(fn)  # a tool without a schema fails here, before any engine is built
        name = getattr(fn, "__name__", spec)
        tools[name] = Tool(name, fn, spec)
    factory = None if env.function in (None, "tools") else load_callable(env.function, "env.function")
    return factory, tools


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` on rank 0 (every rank calls this; only rank 0 runs ``fn``), its value broadcast
    to every rank; an error on rank 0 is broadcast and raised everywhere (rank 0 raises its own)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 (re-raised below after the others learn of it)
            kind = "user" if isinstance(exc, UserCodeError) else "error"
            error, box[0] = exc, (kind, f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0, device=comm_device(None))
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "user":  # one line on every rank, like rank 0's (run_cli), not a traceback per rank
        raise UserCodeError(f"the multi-turn rollout failed on rank 0 ({value}); this rank stops too")
    if kind == "error":
        raise RuntimeError(f"the multi-turn rollout failed on rank 0 ({value}); this rank stops too")
    return value


# The multi-turn finished batch is the producers' ScoredBatch (its name before the producer seam).
AgentBatch = ScoredBatch

__all__ = ["AgentBatch", "AgentLoop", "AgentRun", "ToolCall"]
