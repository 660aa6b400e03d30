"""``ToolOptions``: how a session uses its tools (checked once, when given)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidParamsError

DEFAULT_MAX_TOOL_ROUNDS = 8
DEFAULT_TOOL_TIMEOUT = 60.0  # seconds a tool call may take (``None``: no limit)


@dataclass(frozen=True)
class ToolOptions:
    """How a session uses its tools: ``execution`` ``"auto"`` (chatkit calls them and loops) or
    ``"manual"`` (the calls go back to the app); at most ``max_rounds`` rounds of results per prompt;
    ``errors`` ``"return"`` (the model reads the error as the result) or ``"raise"``; ``strict``: tool
    calls are constrained to the tools' schemas (``chatkit.guided.call_grammar``); ``timeout``: seconds
    a call may take before it fails (``None``: no limit)."""

    execution: str = "auto"
    max_rounds: int = DEFAULT_MAX_TOOL_ROUNDS
    errors: str = "return"
    strict: bool = False
    timeout: float | None = DEFAULT_TOOL_TIMEOUT

    def validate(self) -> None:
        if self.execution not in ("auto", "manual"):
            raise InvalidParamsError(f"tool_execution={self.execution!r}: use 'auto' or 'manual'.")
        if not isinstance(self.max_rounds, int) or isinstance(self.max_rounds, bool) or self.max_rounds < 0:
            raise InvalidParamsError(f"max_tool_rounds={self.max_rounds!r}: use an int >= 0.")
        if self.errors not in ("return", "raise"):
            raise InvalidParamsError(f"tool errors={self.errors!r}: use 'return' (tell the model) or 'raise'.")
        if not isinstance(self.strict, bool):
            raise InvalidParamsError(f"strict_tools={self.strict!r}: use True or False.")
        t = self.timeout
        if t is not None and (not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t <= 0):
            raise InvalidParamsError(f"tool_timeout={t!r}: use seconds > 0 (e.g. 60), or None for no limit.")


__all__ = ["DEFAULT_MAX_TOOL_ROUNDS", "DEFAULT_TOOL_TIMEOUT", "ToolOptions"]
