"""Reward functions for the RL recipe: loading the user's by name, calling them safely, and the
built-ins.

``reward.function`` names a Python callable: ``"package.module:function"`` (imported),
``"path/to/file.py:function"`` (the file is loaded as a module; it is the user's own code,
named in their config, never anything read from a checkpoint) or a built-in's bare name
(``exact_match``, ``math_answer``). It is called on the decoded text:

    fn(prompt: str, response: str, **columns) -> float

where ``prompt`` is the rendered prompt the model saw (chat template and generation prompt
included), ``response`` the sampled response decoded without special tokens (so without EOS),
and ``columns`` every other column of the prompt's row (e.g. ``answer``). With
``reward.batched: true`` it is called once per step with lists instead:
``fn(prompts: list[str], responses: list[str], **columns: list) -> list[float]``.

Rewards are computed on rank 0 and broadcast, so a function with side effects (a judge call,
a log) runs once per response. An exception, a non-number or a non-finite value stops the step
before any update with an error naming the row.

The function is the user's code, so it is fenced: anything it raises, ``BaseException``s
included (``sys.exit`` in it or in a library it calls, ``GeneratorExit``), becomes a
``RewardError`` naming ``reward.function``; a ``KeyboardInterrupt`` stays an interrupt. Either way
every rank learns of it through the step's one collective and stops at once (no rank is left
waiting for a collective timeout). ``reward.timeout_s`` bounds one call (one response, or the
whole step for a batched function): the call then runs in a daemon thread, and a call past the
limit is abandoned (a Python thread cannot be killed; it may keep running until the process
exits, which it then does with an error). With ``timeout_s: null`` the function runs in the main
thread with no limit (for code that needs the main thread, e.g. ``signal.alarm`` timeouts).
"""

from __future__ import annotations

import inspect
import math
import numbers as _numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine_api.dist import all_reduce, comm_device, is_initialized
from posttrain.fencing import FencedTimeout, RowFailure, fenced, fenced_each, is_path_spec, load_callable
from posttrain.reward_shaping import OverlongConfig

RewardFn = Callable[..., float]

# The default bound on one reward call: far above any scoring function's or judge call's normal
# time, and below the default collective timeout the other ranks wait under meanwhile (torch's 30
# minutes; they wait for all of a step's calls, so a slow per-response function still wants
# reward.batched or a larger engine.dist_timeout_s).
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RewardConfig:
    """The ``reward`` section of the RL recipe.

    Attributes:
        function: ``package.module:function``, ``path/to/file.py:function`` or a built-in name
            (``exact_match``, ``math_answer``); null: the sorting task's own scorer (only
            without data files).
        batched: call the function once per step with lists (see the module docstring).
        timeout_s: seconds one call may take (one response; with ``batched``, the whole step's
            responses); a call past it stops the run naming the function. It then runs in a
            daemon thread (abandoned on timeout). null: no limit, called in the main thread.
        overlong: DAPO's soft overlong penalty on the score (``posttrain.reward_shaping``; off
            by default).
        model: a reward model's HF directory (a one-output sequence-classification model, e.g.
            ``recipes.reward_model``'s export): each response's reward adds ``model_weight``
            times its score (``roles.reward_model``); null: none.
        model_weight: the reward model score's weight.
        function_weight: the function's (or the task scorer's) weight in the reward; 0 with a
            reward model keeps the function as a held-out measure only (``reward/function_mean``,
            ``val/reward``), which shows a policy over-optimising the learned reward.
    """

    function: str | None = None
    batched: bool = False
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    model: str | None = None
    model_weight: float = 1.0
    function_weight: float = 1.0

    def _problems(self) -> list[str]:
        weights = []
        if not self.function_weight >= 0:
            weights.append(f"function_weight = {self.function_weight}: must be >= 0; fix: 1.0, or 0 (the function only measured)")
        if self.model is not None and not self.model_weight > 0:
            weights.append(f"model_weight = {self.model_weight}: must be > 0 with a reward model; fix: e.g. 1.0")
        if self.model is None and self.function_weight != 1.0:
            weights.append(f"function_weight = {self.function_weight} without reward.model: nothing to weigh it against; fix: 1.0")
        if weights:
            return weights
        if self.timeout_s is not None and not self.timeout_s > 0:
            return [f"timeout_s = {self.timeout_s}: must be positive; fix: seconds > 0, e.g. {DEFAULT_TIMEOUT_S:g}, or null (no limit)"]
        if self.function is None or self.function in BUILTINS:
            return []
        module, sep, name = self.function.rpartition(":")
        if not sep or not module or not name:
            return [
                f"function = {self.function!r}: expected 'package.module:function', 'path/to/file.py:function' or one of "
                f"{', '.join(BUILTINS)}; fix: add ':function_name'"
            ]
        if is_path_spec(module) and not os.path.isfile(module):
            return [f"function = {self.function!r}: file {module!r} does not exist (working directory {os.getcwd()}); fix: give its path"]
        return []


def load_reward_fn(spec: str) -> RewardFn:
    """The callable ``spec`` names (see the module docstring).

    Raises:
        ValueError: the module, file or attribute cannot be found, or is not callable.
    """
    if spec in BUILTINS:
        return BUILTINS[spec]
    return load_callable(spec, "reward.function")


def check_reward_columns(fn: RewardFn, spec: str, columns: set[str]) -> None:
    """Refuse data columns that would clash with ``fn``'s own first two parameters (the
    prompt(s) and response(s), passed by position) when passed by name.

    Raises:
        ValueError: naming the column and the fix.
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # not introspectable (a builtin or C function): nothing to check
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    clash = sorted(p.name for p in positional if p.kind is p.POSITIONAL_OR_KEYWORD and p.name in columns)
    if clash:
        raise ValueError(
            f"reward.function = {spec!r}: the data has column(s) {clash}, which would also fill the function's parameter(s) of "
            "the same name (the prompt and response are passed by position); fix: rename the column(s) in the data, or the "
            "function's parameters"
        )


class RewardError(RuntimeError):
    """A reward function failed, timed out, or returned something that is not a finite number."""


def compute_rewards(
    fn: RewardFn,
    batched: bool,
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Sequence[Mapping[str, object]],
    sources: Sequence[str],
    name: str | None = None,
    timeout_s: float | None = None,
) -> torch.Tensor:
    """``fn``'s reward of every response (float64 [N]), on rank 0, broadcast to every rank.

    ``name``: how messages call the function (``reward.function``'s spec; default its qualified
    name). ``timeout_s``: the bound on one call (``RewardConfig.timeout_s``; None: none, and the
    function runs in the calling thread).

    Raises:
        RewardError: on every rank, when ``fn`` raises anything (``SystemExit`` included),
            times out, or returns a non-number or a non-finite value; rank 0's message names the
            function and the row (its file and line or index).
        KeyboardInterrupt: on every rank, when ``fn`` raised it or the user interrupted rank 0
            while it ran.
    """
    name = name or getattr(fn, "__qualname__", repr(fn))
    # [0]: rank 0 finished; [1]: rank 0 was interrupted; [2:]: the rewards.
    values = torch.zeros(len(prompts) + 2, dtype=torch.float64)
    error: BaseException | None = None
    if not is_initialized() or torch.distributed.get_rank() == 0:
        try:
            values[2:] = torch.tensor(_call(fn, name, batched, timeout_s, prompts, responses, columns, sources), dtype=torch.float64)
            values[0] = 1.0
        except RewardError as exc:
            error = exc
        except KeyboardInterrupt as exc:
            error, values[1] = exc, 1.0
    if is_initialized():
        # The only collective of the step's scoring, reached by every rank whatever the function
        # did, so a failure on rank 0 stops every rank now (only rank 0 contributes).
        values = all_reduce(values.to(comm_device(None)), "sum", None).cpu()
    if error is not None:
        raise error
    if values[1] == 1.0:
        raise KeyboardInterrupt(f"reward.function = {name!r} was interrupted on rank 0; this rank stops too")
    if values[0] != 1.0:
        raise RewardError(f"reward.function = {name!r} failed on rank 0 (its error names the row); this step made no update")
    return values[2:]


def _call(fn, name, batched, timeout_s, prompts, responses, columns, sources) -> list[float]:
    fix = "fix: make the function return a finite float for every row"

    def failed(exc: BaseException, where: str) -> RewardError:
        if isinstance(exc, FencedTimeout):
            what = f"did not return within reward.timeout_s = {timeout_s:g} s (the call was abandoned: a thread cannot be stopped)"
            advice = "fix: make it faster, or raise reward.timeout_s (null: no limit)"
        elif isinstance(exc, SystemExit):
            what = f"raised {exc!r} (sys.exit, in the function or a library it calls)"
            advice = "fix: a reward function must return a number; raise an exception instead of exiting"
        else:
            what = f"raised {exc!r}"
            advice = fix
            if isinstance(exc, ValueError) and "main thread" in str(exc) and timeout_s is not None:
                advice += "; it needs the main thread (e.g. signal.alarm): set reward.timeout_s=null to call it there"
        return RewardError(f"reward.function = {name!r} {where}: {what}; the run stops before any update; {advice}")

    def bad(i: int, what: str) -> RewardError:
        return RewardError(
            f"reward.function = {name!r} on row {sources[i]} (sample {i} of this step): {what}; the step stops before any update; {fix}"
        )

    if batched:
        keys = sorted({k for c in columns for k in c})
        lists = {k: [c.get(k) for c in columns] for k in keys}
        try:
            # list() inside the fence: a generator's body runs while it is consumed
            out = fenced(lambda: list(fn(list(prompts), list(responses), **lists)), timeout_s)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 (user code: SystemExit, GeneratorExit, ... are failures too)
            raise failed(exc, f"(batched) on the rows {sources[0]} .. {sources[-1]}") from exc
        if len(out) != len(prompts):
            raise RewardError(
                f"reward.function = {name!r} (batched) returned {len(out)} rewards for {len(prompts)} responses; fix: one per response"
            )
    else:
        calls = [lambda p=p, r=r, c=c: fn(p, r, **c) for p, r, c in zip(prompts, responses, columns, strict=True)]
        try:
            out = fenced_each(calls, timeout_s)
        except RowFailure as row:
            if isinstance(row.error, KeyboardInterrupt):
                raise row.error from None
            i = row.index
            raise failed(row.error, f"on row {sources[i]} (sample {i} of this step)") from row.error
    checked = []
    for i, v in enumerate(out):
        value = as_reward(v)
        if value is None:
            raise bad(i, f"returned {v!r} ({type(v).__name__}), not a number")
        if not math.isfinite(value):
            raise bad(i, f"returned {value}")
        checked.append(value)
    return checked


def as_reward(value: object) -> float | None:
    """``value`` as a float when it is a real number: a Python or NumPy int / float scalar (any
    ``numbers.Real``), or a one-element tensor; None for anything else, bools included (a
    ``True`` reward is more likely a bug than a score). Non-finite values are returned as they
    are: the caller names them."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # NumPy's bool is no Real, but be explicit
        return None
    if isinstance(value, _numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
        return float(value)
    return None


# ---------------------------------------------------------------------------------- built-ins
def _norm(text: object) -> str:
    return " ".join(str(text).strip().split())


def exact_match(prompt: str, response: str, answer: object = None, **columns) -> float:
    """1.0 when the response, whitespace-normalised, equals the row's ``answer`` column."""
    if answer is None:
        raise KeyError("the row has no 'answer' column (exact_match compares the response with it)")
    return float(_norm(response) == _norm(answer))


# A number not glued to a preceding digit (so "2023-2024" gives 2024, not -2024): an integer
# with optional thousands commas, a decimal, or a fraction a/b.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d[\d,]*(?:\.\d+)?(?:/\d+)?|\.\d+)")


def extract_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces allowed), else the
    last number in it (thousands commas allowed); None when there is neither."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        begin = i
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[begin : i - 1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> float | None:
    """``text`` as a number: ``1,200``, ``$3.50``, ``-7``, ``3/4``, ``\\frac{3}{4}``; None otherwise."""
    t = text.replace(",", "").replace("$", "").strip().rstrip(".")
    frac = re.fullmatch(r"(-?)\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", t) or re.fullmatch(r"(-?)(-?\d+)/(\d+)", t)
    try:
        if frac:
            sign = -1.0 if frac.group(1) else 1.0
            return sign * float(frac.group(2)) / float(frac.group(3)) if float(frac.group(3)) else None
        return float(t)
    except ValueError:
        return None


def reference_answer(answer: object) -> str:
    """The expected final answer of a dataset's ``answer`` column: after GSM8K's ``####``
    marker when present, else inside its last ``\\boxed{...}``, else the whole value."""
    text = str(answer)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    if "\\boxed{" in text:
        return extract_answer(text) or text
    return text.strip()


def math_answer(prompt: str, response: str, answer: object = None, **columns) -> float:
    """1.0 when the response's final answer (``extract_answer``) equals the row's expected answer
    (``reference_answer``: a plain value, GSM8K's ``... #### 72``, or a ``\\boxed{}``):
    numerically when both parse as numbers (``12``, ``12.0``, ``1,200``, ``3/4``), else as
    normalised text."""
    if answer is None:
        raise KeyError("the row has no 'answer' column (math_answer compares the response's final answer with it)")
    got = extract_answer(response)
    if got is None:
        return 0.0
    want = reference_answer(answer)
    a, b = _as_number(got), _as_number(want)
    if a is not None and b is not None:
        return float(math.isclose(a, b, rel_tol=0.0, abs_tol=1e-9 * max(1.0, abs(b))))
    return float(_norm(got) == _norm(want))


def sort_task_score(response: Sequence[int], target: Sequence[int]) -> float:
    """The sorting task's scorer (token ids, no tokenizer): the fraction of target positions
    (sorted digits, then EOS) the response gets right."""
    return sum(1 for i, tok in enumerate(target) if i < len(response) and response[i] == tok) / len(target)


BUILTINS: dict[str, RewardFn] = {"exact_match": exact_match, "math_answer": math_answer}
