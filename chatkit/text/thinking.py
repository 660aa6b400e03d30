"""``ThinkingBudget``: a logits processor that ends a reply's reasoning after a number of tokens."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx


class ThinkingBudget:
    """A logits processor that ends reasoning after ``budget`` tokens: it forces the end-of-thinking
    marker's tokens, then lets the model answer. ``start_in_reasoning`` when the prompt left a think
    block open; ``prompt_length``: the prompt tokens before the reply in what it is shown (a token
    source shows processors the whole prompt, then every generated token: ``engine.Request``).

    What it forces is a function of the tokens it is shown, so a speculative source may call it for
    drafts it later rejects, and a draft model with it drafts the forced marker too: the reply is the
    one plain decoding gives. (It keeps the states of the reply's prefixes, so each call costs the
    tokens that are new since a call it shares a prefix with.)"""

    def __init__(self, tokenizer: Any, budget: int, *, start_in_reasoning: bool, prompt_length: int) -> None:
        self._start = list(tokenizer.think_start_tokens or ())
        self._end = list(tokenizer.think_end_tokens or ())
        self._budget = budget
        self._prompt = prompt_length
        self._seen: list[int] = []  # the reply's tokens whose states are known
        # The state after reply[:i], for each i: (in reasoning, the reply index its reasoning began at).
        self._states: list[tuple[bool, int]] = [(start_in_reasoning, 0)]

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        reply = cast(list[int], tokens[self._prompt :].tolist()) if tokens.size > self._prompt else []
        in_reasoning, begin = self._state_after(reply)
        if not in_reasoning or not self._end:
            return logits
        n, end = len(reply), self._end
        # The marker's first tokens may be forced already (a marker of several tokens): force the next.
        done = next((j for j in range(len(end) - 1, 0, -1) if n - j >= begin and reply[n - j :] == end[:j]), 0)
        if n - done - begin < self._budget:
            return logits
        forced = mx.full(logits.shape, -float("inf"), dtype=logits.dtype)
        forced[..., end[done]] = 0.0
        return forced

    def _state_after(self, reply: list[int]) -> tuple[bool, int]:
        seen = self._seen
        if reply[: len(seen)] != seen:  # another branch (a rejected draft): back to the shared prefix
            shared = next((i for i, (a, b) in enumerate(zip(seen, reply)) if a != b), min(len(seen), len(reply)))
            del seen[shared:], self._states[shared + 1 :]
        in_reasoning, begin = self._states[-1]
        for token in reply[len(seen) :]:
            seen.append(token)
            if in_reasoning and self._end and seen[-len(self._end) :] == self._end:
                in_reasoning = False
            elif not in_reasoning and self._start and seen[-len(self._start) :] == self._start:
                in_reasoning, begin = True, len(seen)
            self._states.append((in_reasoning, begin))
        return in_reasoning, begin


__all__ = ["ThinkingBudget"]
