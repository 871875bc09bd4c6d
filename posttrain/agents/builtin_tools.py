"""Tools that ship with the library, for ``env.tools`` (e.g. ``posttrain.agents.builtin_tools:calculator``)."""

from __future__ import annotations

import ast
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
_MAX_POWER = 64  # 10 ** 64 is plenty for arithmetic word problems; 9 ** 9 ** 9 would hang the tool


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
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
