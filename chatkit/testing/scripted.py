"""``Scripted``: a logits processor that makes a random-weight test model write given replies.

Random weights cannot produce a model family's output format (``<think>`` blocks, tool calls); a
scripted processor forces the tokens of each reply in turn, then the end-of-turn token, so that the
rest of chatkit (segmenting, history, templates, cache reuse) runs on real formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx


class Scripted:
    """Forces ``replies[0]`` (its tokens, then ``end_token``) in the first turn it runs in, ``replies[1]`` in the
    next, and so on; after the last reply the model samples freely. Use it as
    ``GenerateParams(logits_processors=[Scripted(tokenizer, [...])])``."""

    def __init__(self, tokenizer: Any, replies: Sequence[str], *, end_token: int | None = None) -> None:
        # The end of a reply: the tokenizer's own EOS (what its template writes after a reply), unless given.
        self._eos = end_token if end_token is not None else tokenizer.eos_token_id
        self.replies = [list(tokenizer.encode(r, add_special_tokens=False)) + [self._eos] for r in replies]
        self.turn = 0  # the reply being forced
        self._at = 0  # its next token

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.turn >= len(self.replies):
            return logits
        if self._at == 0 and self.turn > 0 and int(cast(int, tokens[-1].item())) == self.replies[self.turn - 1][-1]:
            return logits  # mlx-lm computes one step past the end-of-turn token: not a new turn yet
        reply = self.replies[self.turn]
        token = reply[self._at]
        self._at += 1
        if self._at == len(reply):
            self.turn, self._at = self.turn + 1, 0
        forced = mx.full(logits.shape, -1e9, dtype=logits.dtype)
        forced[..., token] = 0.0
        return forced


__all__ = ["Scripted"]
