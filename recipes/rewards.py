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
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine_api.dist import all_reduce, comm_device, is_initialized

RewardFn = Callable[..., float]


@dataclass(frozen=True)
class RewardConfig:
    """The ``reward`` section of the RL recipe.

    Attributes:
        function: ``package.module:function``, ``path/to/file.py:function`` or a built-in name
            (``exact_match``, ``math_answer``); null: the sorting task's own scorer (only
            without data files).
        batched: call the function once per step with lists (see the module docstring).
    """

    function: str | None = None
    batched: bool = False

    def _problems(self) -> list[str]:
        if self.function is None or self.function in BUILTINS:
            return []
        module, sep, name = self.function.rpartition(":")
        if not sep or not module or not name:
            return [
                f"function = {self.function!r}: expected 'package.module:function', 'path/to/file.py:function' or one of "
                f"{', '.join(BUILTINS)}; fix: add ':function_name'"
            ]
        if _is_path(module) and not os.path.isfile(module):
            return [f"function = {self.function!r}: file {module!r} does not exist (working directory {os.getcwd()}); fix: give its path"]
        return []


def _is_path(module: str) -> bool:
    return module.endswith(".py") or os.sep in module or "/" in module


def load_reward_fn(spec: str) -> RewardFn:
    """The callable ``spec`` names (see the module docstring).

    Raises:
        ValueError: the module, file or attribute cannot be found, or is not callable.
    """
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, _, attr = spec.rpartition(":")
    # A stable, unique module name per file, so pickling and tracebacks name it.
    name = "enginekit_reward_" + re.sub(r"\W", "_", os.path.abspath(module_name))
    try:
        if _is_path(module_name):
            path = os.path.abspath(module_name)
            module = sys.modules.get(name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(name, path)
                if loader_spec is None or loader_spec.loader is None:
                    raise ImportError(f"not a Python file: {path}")
                module = importlib.util.module_from_spec(loader_spec)
                sys.modules[name] = module
                loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 (user code may raise anything while importing)
        sys.modules.pop(name, None)
        raise ValueError(f"reward.function = {spec!r}: cannot load {module_name!r}: {exc!r}; fix: check the module or file") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.function = {spec!r}: {module_name!r} has no callable {attr!r}; fix: name a function defined there")
    return fn


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
    """A reward function failed or returned something that is not a finite number."""


def compute_rewards(
    fn: RewardFn,
    batched: bool,
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Sequence[Mapping[str, object]],
    sources: Sequence[str],
) -> torch.Tensor:
    """``fn``'s reward of every response (float64 [N]), on rank 0, broadcast to every rank.

    Raises:
        RewardError: on every rank, when ``fn`` raises or returns a non-number or a
            non-finite value; rank 0's message names the row (its file and line or index)."""
    values = torch.zeros(len(prompts) + 1, dtype=torch.float64)
    error: Exception | None = None
    if not is_initialized() or torch.distributed.get_rank() == 0:
        try:
            values[1:] = torch.tensor(_call(fn, batched, prompts, responses, columns, sources), dtype=torch.float64)
            values[0] = 1.0
        except RewardError as exc:
            error = exc
    if is_initialized():
        values = all_reduce(values.to(comm_device(None)), "sum", None).cpu()  # only rank 0 contributes
    if error is not None:
        raise error
    if values[0] != 1.0:
        raise RewardError("the reward function failed on rank 0 (its error names the row); this step made no update")
    return values[1:]


def _call(fn, batched, prompts, responses, columns, sources) -> list[float]:
    def bad(i: int, what: str) -> RewardError:
        return RewardError(
            f"reward.function on row {sources[i]} (sample {i} of this step): {what}; the step stops before any update; "
            "fix: make the function return a finite float for every row"
        )

    if batched:
        keys = sorted({k for c in columns for k in c})
        lists = {k: [c.get(k) for c in columns] for k in keys}
        try:
            out = list(fn(list(prompts), list(responses), **lists))
        except Exception as exc:  # noqa: BLE001 (user code)
            raise RewardError(
                f"reward.function (batched) raised {exc!r} on the rows {sources[0]} .. {sources[-1]}; no update was made"
            ) from exc
        if len(out) != len(prompts):
            raise RewardError(f"reward.function (batched) returned {len(out)} rewards for {len(prompts)} responses; fix: one per response")
    else:
        out = []
        for i, (p, r, c) in enumerate(zip(prompts, responses, columns, strict=True)):
            try:
                out.append(fn(p, r, **c))
            except Exception as exc:  # noqa: BLE001 (user code)
                raise bad(i, f"raised {exc!r}") from exc
    checked = []
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
            raise bad(i, f"returned {v!r} ({type(v).__name__}), not a number")
        v = float(v)
        if not math.isfinite(v):
            raise bad(i, f"returned {v}")
        checked.append(v)
    return checked


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
