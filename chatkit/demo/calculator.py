"""The demo's ``calculate`` tool: exact arithmetic on + - * / and parentheses, without ``eval``.

Python's ``ast`` parses the expression and a short walk evaluates it over ``fractions.Fraction`` (exact,
so ``0.1 + 0.2`` is ``0.3`` and ``1 / 3 * 3`` is ``1``). Our own walk rather than a library: the few
nodes it needs fit in a screen, and every other node (names, calls, attributes, ``**``, comparisons...)
is refused by construction.
"""

from __future__ import annotations

import ast
from fractions import Fraction

from ..errors import InvalidParamsError

MAX_LENGTH = 200  # characters of an expression
MAX_DIGITS = 60  # digits of any intermediate value: a long chain of products stays small and fast

_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _refuse(why: str) -> InvalidParamsError:
    return InvalidParamsError(f"{why} The calculator takes numbers, + - * / and parentheses, e.g. '12 * (3 + 4)'.")


def _bounded(value: Fraction) -> Fraction:
    if max(len(str(abs(value.numerator))), len(str(value.denominator))) > MAX_DIGITS:
        raise _refuse(f"A number or result has more than {MAX_DIGITS} digits.")
    return value


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, str, complex...
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        inner = _value(node.operand)
        return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise _refuse("Division by zero.")
        return _bounded(_OPS[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        symbol = {ast.Pow: "**", ast.FloorDiv: "//", ast.Mod: "%"}.get(type(node.op), type(node.op).__name__)
        raise _refuse(f"The operator {symbol} is not supported.")
    raise _refuse(f"{type(node).__name__} is not allowed in an expression.")


def format_number(value: Fraction) -> str:
    """An integer as is; anything else as a decimal rounded to 6 places, without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    micro = round(value * 10**6)  # rounds half to even, as round() does
    sign, micro = ("-" if micro < 0 else ""), abs(micro)
    text = f"{micro // 10**6}.{micro % 10**6:06d}".rstrip("0").rstrip(".")
    return "0" if text == "0" else sign + text


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly, with + - * / and parentheses.

    Args:
        expression: The arithmetic to do, e.g. "12 * (3 + 4)".
    """
    if not isinstance(expression, str):
        raise _refuse(f"The expression must be text, got {type(expression).__name__}.")
    if len(expression) > MAX_LENGTH:
        raise _refuse(f"The expression is longer than {MAX_LENGTH} characters.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise _refuse(f"{expression!r} is not an arithmetic expression.") from None
    return format_number(_value(tree.body))


__all__ = ["calculate", "format_number"]
