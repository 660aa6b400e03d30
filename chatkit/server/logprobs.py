"""OpenAI's ``logprobs``: the log-probability of each token of a reply's text, and the most likely
tokens at its step, read from the stream's chunks (``StreamChunk.logprobs``) only when a request asks.

A log-probability is the model's log-softmax at that step, of the logits after the request's own
processors (``logit_bias``, penalties, a forced tool call) and before ``temperature`` and ``top_p``:
the model's distribution, not the one sampled from (as mlx-lm reports it). Only the answer's tokens
are listed (``kind`` text): not reasoning, tool calls, markers or the end-of-turn token. A token is
its decoded text (a token that ends inside a character shows U+FFFD) and that text's UTF-8 ``bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..session.results import StreamChunk
from ..text.reply import PieceKind
from .errors import BadRequestError

MAX_TOP = 20
FLOOR = -9999.0  # what OpenAI sends for a token that cannot be chosen (JSON has no -Infinity)


def read_logprobs(body: Mapping[str, Any]) -> int | None:
    """A chat completions request's ``logprobs`` / ``top_logprobs``: ``None`` when not asked, else how
    many top tokens each entry lists (0 to 20)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequestError("logprobs must be true or false.", param="logprobs")
    if top is not None and not wanted:
        raise BadRequestError("top_logprobs needs logprobs: true.", param="top_logprobs")
    return read_top(top) if wanted else None


def read_included(body: Mapping[str, Any]) -> int | None:
    """A Responses request's ``include: ["message.output_text.logprobs"]`` and ``top_logprobs``:
    ``None`` when not asked, else how many top tokens each entry lists."""
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise BadRequestError("include must be a list of strings.", param="include")
    top = read_top(body.get("top_logprobs"))
    return top if "message.output_text.logprobs" in include or top else None


def read_top(top: Any, param: str = "top_logprobs") -> int:
    """``top_logprobs``: an int from 0 to 20 (absent: 0)."""
    if top is None:
        return 0
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP:
        raise BadRequestError(f"{param} must be an integer from 0 to {MAX_TOP}.", param=param)
    return top


class Logprobs:
    """The entries of a reply's text tokens, from its chunks as they stream (see the module docstring)."""

    def __init__(self, tokenizer: Any, top: int) -> None:
        self._tokenizer = tokenizer
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self._top = top
        self._last: Any = None  # the logprobs of the last token read (a token's chunks share them)
        self._pending: list[dict[str, Any]] = []
        self._texts: dict[int, str] = {}
        self.entries: list[dict[str, Any]] = []

    def feed(self, chunk: StreamChunk) -> None:
        """Read one chunk: a text token's first chunk adds its entry."""
        if chunk.kind != PieceKind.TEXT or chunk.logprobs is None or chunk.logprobs is self._last or chunk.token in self._eos:
            return
        self._last = chunk.logprobs
        entry = self._entry(chunk.token, chunk.token_logprob())
        entry["top_logprobs"] = [self._entry(t, lp) for t, lp in chunk.top_logprobs(self._top)]
        self._pending.append(entry)
        self.entries.append(entry)

    def take(self) -> list[dict[str, Any]]:
        """The entries read since the last call (what a stream chunk carries)."""
        pending, self._pending = self._pending, []
        return pending

    def _entry(self, token: int, logprob: float | None) -> dict[str, Any]:
        text = self._texts.get(token)
        if text is None:  # each token decoded once per request (top_logprobs repeats the same few)
            text = self._texts[token] = self._tokenizer.decode([token])
        value = FLOOR if logprob is None or not math.isfinite(logprob) else max(logprob, FLOOR)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}


__all__ = ["MAX_TOP", "Logprobs", "read_included", "read_logprobs", "read_top"]
