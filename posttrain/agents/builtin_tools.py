"""Tools that ship with the library, for ``env.tools`` (e.g. ``posttrain.agents.builtin_tools:calculator``).

Imports nothing heavy: tools run in worker processes (``posttrain.agents.tool_runner``) that
import them by path.
"""

from __future__ import annotations

import ast
import math
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# The largest integer the calculator computes, in bits (about 1,000 decimal digits): far beyond
# arithmetic word problems, and small enough that no step costs more than microseconds. Every
# integer power and product is sized BEFORE it is computed (a power tower like
# ((10**64)**64)**64 would otherwise hold the GIL for minutes in one C call); floats overflow
# to an error on their own.
MAX_BITS = 3400


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(48 / 2) + 48".
    """
    tree = ast.parse(expression.strip(), mode="eval")  # parsed, never eval'd: nothing but arithmetic runs
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _sized(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        _check_size(node.op, left, right)
        return _sized(_OPS[type(node.op)](left, right))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


def _check_size(op: ast.operator, left: float, right: float) -> None:
    """Refuse an integer power or product whose result would exceed ``MAX_BITS`` (estimated
    from the operands' sizes, before computing it)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return  # a float result overflows to OverflowError by itself, at once
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        bits = right * math.log2(abs(left))
        if bits > MAX_BITS:
            raise ValueError(f"the result of {_short(left)} ** {_short(right)} would have about {bits:.3g} bits (at most {MAX_BITS})")
    if isinstance(op, ast.Mult) and abs(left).bit_length() + abs(right).bit_length() > MAX_BITS + 1:
        raise ValueError(f"the product would have more than {MAX_BITS} bits")


def _sized(value: float) -> float:
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"a number of {value.bit_length()} bits (at most {MAX_BITS})")
    return value


def _short(value: int) -> str:
    text = str(value)
    return text if len(text) <= 12 else f"{text[:4]}...({len(text)} digits)"
