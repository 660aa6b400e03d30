"""One guided turn's constraint: an llguidance matcher over the generated tokens, a token mask for
every step, and an mlx-lm logits processor ``(tokens, logits) -> logits`` around them.

    c = Constraint(spec, lm.tokenizer)                  # raises InvalidOutputSpecError up front
    for token, _ in generate_step(prompt, model, logits_processors=[c]):
        ...                                             # c masks every step, the first one included
    value = c.finish()                                  # the value, or IncompleteOutputError

The processor keeps the matcher in step with the tokens it is shown: it remembers how many tokens
the first call showed (the prompt) and treats the rest as the reply, rolling the matcher back when
the reply shown is shorter or differs (mlx-lm's speculative step shows draft tokens, then the
verified ones). So it works unchanged under ``generate_step`` and ``speculative_generate_step``.

Speculative decoding (mlx-lm 0.32): the processors are applied to the draft model's logits and to
each verified position of the target's, in order; at position i the processor is shown the
target's own choices before i, so every accepted token was masked by the state of the tokens before
it, and greedy output equals non-speculative guided output (tested). Draft tokens are masked as well,
so they are grammar-valid by construction. A token source that does not mask its draft can call
:meth:`Constraint.check_draft` and treat the first refused draft token as a mismatch.

Overlap: queue the tokens so far, then ``mx.async_eval(logits)``, then read the tokens (which waits
for the previous token only) and run the matcher: the forward pass of this step runs while llguidance
computes the mask on the CPU (it drops the GIL). Only the masking and sampling wait for the mask.
A read of the tokens queued after the forward pass would wait for the whole pass, and nothing would
overlap. Measured in ``bench/guided.py``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from ..cache.planner import common_prefix_length
from ..errors import ChatKitError, InvalidOutputSpecError
from .spec import OutputSpec, beyond_matcher
from .tokenizer import llg_tokenizer


class Constraint:
    """The constraint of one guided reply (one per turn; not thread-safe).

    ``think_end`` (token ids, or text the tokenizer encodes) makes the reply start free: the grammar
    applies from the token after the first occurrence of the marker, so reasoning is not
    constrained (only the end of the reply is withheld until the answer is complete). With
    ``think_start`` too (one token id, or its text), reasoning is optional: the reply may open with
    ``think_start`` (then it is free until ``think_end``) or start with the answer at once.
    ``max_reasoning``: after that many reasoning tokens the end marker is forced (``None``: no bound).
    ``never``: token ids the answer may not hold (e.g. the think start marker: a reply whose thinking
    is off, or whose reasoning has ended, cannot open a block). ``overlap``
    (the default) starts the model's forward pass before the mask is computed on the CPU, so the
    two run at the same time (see ``bench/guided.py``).
    """

    def __init__(
        self,
        spec: OutputSpec,
        tokenizer: Any,
        *,
        think_end: Sequence[int] | str | None = None,
        think_start: int | str | None = None,
        max_reasoning: int | None = None,
        never: Sequence[int] = (),
        overlap: bool = True,
    ) -> None:
        self.spec = spec
        self._llt = llg_tokenizer(tokenizer)
        self._matcher = llguidance.LLMatcher(self._llt, spec.grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidOutputSpecError(
                f"The output grammar does not compile for this tokenizer: {self._matcher.get_error().strip()}."
            )
        if isinstance(think_end, str):
            think_end = tokenizer.encode(think_end, add_special_tokens=False)
        self._think_end = [int(t) for t in think_end] if think_end is not None else None
        if self._think_end == []:
            raise InvalidOutputSpecError("think_end is empty: give the reasoning block's end marker, or None.")
        if isinstance(think_start, str):
            ids = tokenizer.encode(think_start, add_special_tokens=False)
            if len(ids) != 1:
                raise InvalidOutputSpecError(f"think_start {think_start!r} is {len(ids)} tokens: give a one-token marker.")
            think_start = ids[0]
        if think_start is not None and self._think_end is None:
            raise InvalidOutputSpecError("think_start needs think_end: give both markers of the reasoning block.")
        self._think_start = None if think_start is None else int(think_start)
        if max_reasoning is not None and (not isinstance(max_reasoning, int) or isinstance(max_reasoning, bool) or max_reasoning < 0):
            raise InvalidOutputSpecError(f"max_reasoning={max_reasoning!r}: give an int >= 0, or None.")
        self._max_reasoning = max_reasoning
        self._never = [int(t) for t in never]
        self._eos = list(self._llt.eos_tokens)
        self._overlap = overlap
        self._tokens: list[int] = []  # every reply token shown so far (reasoning included)
        self._answer_start = self._initial_answer_start()  # None: inside the (free) reasoning block
        self._consumed = 0  # tokens the matcher holds: the reply from _answer_start on, ends left out
        self._ended = False  # an end-of-sequence token was taken after the answer
        self._start: int | None = None  # the processor's prompt length (from its first call)
        self._bitmask = np.full((self._llt.vocab_size + 31) // 32, -1, dtype=np.int32)
        self._masked: tuple[int, np.ndarray] | None = None  # (reply length, allowed) of the last mask
        self.mask_seconds = 0.0  # CPU time spent computing masks (for benchmarks)
        self.mask_count = 0

    # -- state ---------------------------------------------------------------------------------

    def _initial_answer_start(self) -> int | None:
        return None if self._think_end is not None and self._think_start is None else 0

    @property
    def tokens(self) -> list[int]:
        """The reply's tokens so far (reasoning included)."""
        return list(self._tokens)

    @property
    def in_reasoning(self) -> bool:
        """Whether the reply is still inside its (free) reasoning block."""
        return self._answer_start is None

    def answer_tokens(self) -> list[int]:
        """The constrained part of the reply, without end-of-sequence tokens."""
        if self._answer_start is None:
            return []
        return [t for t in self._tokens[self._answer_start :] if t not in self._eos]

    def text_of(self, tokens: Sequence[int]) -> str:
        """The constrained text of the reply ``tokens`` (after the reasoning marker, ends dropped),
        without touching the state: e.g. the tokens a stream has handed out so far."""
        tokens = [int(t) for t in tokens]
        start = 0
        opens = self._think_start is None or tokens[:1] == [self._think_start]
        if self._think_end is not None and opens:
            m = len(self._think_end)
            end = next((i + m for i in range(len(tokens) - m + 1) if tokens[i : i + m] == self._think_end), None)
            if end is None:
                return ""
            start = end
        return self._llt.decode_str([t for t in tokens[start:] if t not in self._eos])

    @property
    def text(self) -> str:
        """The constrained text so far: the tokens after the reasoning block, decoded."""
        return self._llt.decode_str(self.answer_tokens())

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete value (the reply may end here)."""
        return self._answer_start is not None and self._matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Whether the reply is over: the grammar admits nothing more, or an end token was taken."""
        if self._answer_start is None:
            return False
        return self._ended or self._matcher.is_stopped()

    def forced_end(self) -> bool:
        """Whether the only token the grammar allows now is the end: a turn may stop without asking
        the model for it (the value is complete and nothing can be added)."""
        return self._answer_start is not None and self._matcher.is_stopped() and not self._matcher.is_error()

    def partial(self) -> Any:
        """The partial value of the text so far (see ``OutputSpec.partial``)."""
        return self.spec.partial(self.text)

    def finish(self, tokens: Sequence[int] | None = None) -> Any:
        """The final value. ``tokens`` (the reply's tokens as the turn kept them) re-syncs first: a
        speculative run may have shown the processor tokens past the last one yielded. Raises
        ``IncompleteOutputError`` (with the partial text) when the value is not complete."""
        if tokens is not None:
            self.sync(tokens)
        return self.spec.parse(self.text, complete=self.is_accepting())

    # -- moving ----------------------------------------------------------------------------------

    def advance(self, token: int) -> None:
        """Take the next reply token. Raises ``ChatKitError`` for a token the grammar refuses (the
        token source did not apply this constraint's mask)."""
        token = int(token)
        self._tokens.append(token)
        if len(self._tokens) == 1 and self._think_start is not None and token == self._think_start:
            self._answer_start = None  # the reply opens its reasoning block
            return
        if self._answer_start is None:
            marker = self._think_end or []
            if self._tokens[-len(marker) :] == marker:
                self._answer_start = len(self._tokens)
            return
        if token in self._eos or self._ended:
            # Ends are kept out of the matcher: llguidance's rollback miscounts an end taken after
            # the grammar stopped, and a speculative run shows the processor ends to roll back.
            if token not in self._eos or not self._matcher.is_accepting():
                self._tokens.pop()
                what = "anything after the end" if self._ended else "the end before the value is complete"
                raise ChatKitError(
                    f"Token {token} is {what}, which the {self.spec.name} grammar refuses: apply the "
                    "constraint to every step (pass it as a logits processor, or call mask_logits)."
                )
            self._ended = True
            return
        if not self._matcher.consume_token(token):
            error = self._matcher.get_error()
            self._tokens.pop()
            # An llguidance matcher stays in its error state: rebuild it so the constraint stays usable.
            self._matcher = llguidance.LLMatcher(self._llt, self.spec.grammar, log_level=0)
            self._matcher.consume_tokens(self._tokens[self._answer_start :])
            if self._was_allowed(token):  # the mask took it: the matcher met one of its own limits
                raise InvalidOutputSpecError(beyond_matcher(f"{self.spec.name} grammar", error))
            error = error.strip().splitlines()[0]
            raise ChatKitError(
                f"Token {token} breaks the {self.spec.name} grammar ({error}): apply the constraint to "
                "every step (pass it as a logits processor, or call mask_logits before sampling)."
            )
        self._consumed += 1

    def _was_allowed(self, token: int) -> bool:
        """Whether the last mask, computed for the reply so far (before ``token``), allowed ``token``."""
        masked = self._masked
        return masked is not None and masked[0] == len(self._tokens) and token < masked[1].size and bool(masked[1][token])

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` reply tokens."""
        n = min(n, len(self._tokens))
        if n <= 0:
            return
        self._masked = None
        new_len = len(self._tokens) - n
        del self._tokens[new_len:]
        if self._answer_start is not None:
            keep = [t for t in self._tokens[self._answer_start :] if t not in self._eos]
            self._ended = any(t in self._eos for t in self._tokens[self._answer_start :])
            if self._consumed > len(keep):
                self._matcher.rollback(self._consumed - len(keep))
                self._consumed = len(keep)
            if new_len < self._answer_start:
                self._answer_start = None
        if new_len == 0:
            self._answer_start = self._initial_answer_start()

    def sync(self, tokens: Sequence[int]) -> None:
        """Bring the state to exactly the reply ``tokens``: roll back past their common prefix with
        what was seen, then advance through the rest."""
        tokens = [int(t) for t in tokens]
        n = len(self._tokens)
        if len(tokens) >= n and tokens[:n] == self._tokens:  # the usual step: one more token
            common = n
        else:
            common = common_prefix_length(self._tokens, tokens)
        self.rollback(len(self._tokens) - common)
        for t in tokens[common:]:
            self.advance(t)

    def check_draft(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar accepts from the current state (the state
        is left as it was). For token sources whose draft model is not masked: a rejected draft
        token counts as a mismatch, so verification stops there."""
        draft = [int(t) for t in draft]
        if self._answer_start is not None:
            return self._matcher.validate_tokens(draft)
        taken = 0
        try:
            for t in draft:
                self.advance(t)
                taken += 1
                if self._answer_start is not None:
                    return taken + self._matcher.validate_tokens(draft[taken:])
            return taken
        finally:
            self.rollback(taken)

    # -- masking ---------------------------------------------------------------------------------

    def allowed(self, vocab_size: int) -> np.ndarray:
        """The tokens allowed next, as a bool array of ``vocab_size`` (the model's logits width)."""
        t0 = time.perf_counter()
        eos = [t for t in self._eos if t < vocab_size]
        if self._answer_start is None:
            forced = self._forced_end()
            allowed = np.zeros(vocab_size, dtype=bool) if forced is not None else np.ones(vocab_size, dtype=bool)
            if forced is not None and forced < vocab_size:
                allowed[forced] = True  # the budget is spent: the end marker, then the answer
            allowed[eos] = False  # no end inside the reasoning: the reply must get to its answer
        elif self._ended:  # a speculative run may look past the end: only more ends
            allowed = np.zeros(vocab_size, dtype=bool)
            allowed[eos] = True
        else:
            self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
            if self._matcher.is_error():  # e.g. a parser limit: no mask to give (the logits would be all -inf)
                raise InvalidOutputSpecError(beyond_matcher(f"{self.spec.name} grammar", self._matcher.get_error()))
            bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little").view(bool)
            if bits.size >= vocab_size:
                allowed = bits[:vocab_size]
            else:  # logits wider than the tokenizer (padded embeddings): those ids are never allowed
                allowed = np.concatenate([bits, np.zeros(vocab_size - bits.size, dtype=bool)])
            allowed[[t for t in self._never if t < vocab_size]] = False
            if not self._tokens and self._think_start is not None and self._think_start < vocab_size:
                allowed[self._think_start] = True  # or open a reasoning block first
            self._masked = (len(self._tokens), allowed)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_count += 1
        return allowed

    def _forced_end(self) -> int | None:
        """The end marker's next token once the reasoning has spent ``max_reasoning`` tokens (a
        marker of several tokens is forced to its end); ``None`` while the reasoning is free."""
        end, budget = self._think_end, self._max_reasoning
        if budget is None or not end:
            return None
        tokens, n = self._tokens, len(self._tokens)
        begin = 1 if self._think_start is not None else 0  # the reply opened the block with its first token
        done = next((j for j in range(len(end) - 1, 0, -1) if n - j >= begin and tokens[n - j :] == end[:j]), 0)
        return end[done] if n - done - begin >= budget else None

    def mask_logits(self, logits: mx.array) -> mx.array:
        """``logits`` (shape ``(..., vocab)``) with every token the grammar refuses next at -inf."""
        # llguidance.mlx applies its bitmask with a Metal kernel, which the CPU build of MLX lacks:
        # the bits are unpacked with NumPy instead and applied with mx.where (one path everywhere).
        allowed = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """mlx-lm logits processor: ``tokens`` are the prompt (first call) and then the prompt plus
        the reply so far; returns ``logits`` masked for the next token."""
        # Queue the tokens, then this step's forward pass, then read the tokens: the read waits for
        # the previous token only, and the pass starts as soon as that token is there, while the
        # matcher works on the CPU. A read queued after the pass would wait for the whole pass (no
        # overlap at all); a read before queueing the pass leaves the model idle until this thread
        # wakes up (measured in bench/guided.py).
        if self._start is None:
            self._start = tokens.size
        if self._overlap:
            mx.async_eval(tokens)
            mx.async_eval(logits)
        # NumPy views the evaluated tokens (no new MLX op to queue behind the pass); only the reply is
        # converted: the prompt before it can be long, and this runs at every token.
        reply: list[int] = np.asarray(tokens)[self._start :].tolist()
        self.sync(reply)
        return self.mask_logits(logits)


def constraint(
    spec: OutputSpec,
    tokenizer: Any,
    *,
    think_end: Sequence[int] | str | None = None,
    think_start: int | str | None = None,
    max_reasoning: int | None = None,
    never: Sequence[int] = (),
    overlap: bool = True,
) -> Constraint:
    """A :class:`Constraint` for one reply of ``spec`` over ``tokenizer``."""
    return Constraint(spec, tokenizer, think_end=think_end, think_start=think_start, max_reasoning=max_reasoning,
                      never=never, overlap=overlap)


__all__ = ["Constraint", "constraint"]
