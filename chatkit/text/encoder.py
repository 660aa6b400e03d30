"""Rendering a chat to its prompt text (through the tokenizer's template), and the prompt encoder: rendered chat text to ids, with two properties a chat session needs and a
plain ``tokenizer.encode`` lacks:

- Message content is text. A user message (or a tool result, or a reply) that contains the string of
  a special token such as ``<|im_end|>`` must not become that token, or it could forge a turn. Before
  rendering, such strings in content are swapped for private-use placeholders; the encoder turns them
  back into their literal text and tokenizes them as text.
- Work in proportion to the new text. Hugging Face tokenizers split the input at added tokens before
  anything else, so the ids of a text are the ids up to an added token followed by the ids from that
  token on. The encoder keeps the last text and its ids and, when a new rendering shares a prefix with
  it, encodes only from the last added token of that prefix.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from jinja2.exceptions import SecurityError

from ..errors import TemplateError
from ..model.tokenizer import chat_template, hf_tokenizer, jinja_environment

# The last few encodings of every session, by tokenizer and settings (see ``PromptEncoder._adopt_recent``).
_RECENT: weakref.WeakKeyDictionary[Any, dict[bool, deque[tuple[str, list[int], list[tuple[int, int]]]]]] = (
    weakref.WeakKeyDictionary())
_RECENT_LOCK = threading.Lock()

# Content placeholders: a marker character, then one character naming the special token.
_MARK = "\U000f0000"
_FIRST = 0xF0001
_LAST = 0xFFFFD


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    template: str | None,
    template_kwargs: Mapping[str, Any],
) -> Any:
    """The rendered prompt text, through mlx-lm's wrapper (which maps the thinking switch and runs
    Python chat templates) and then transformers' sandboxed jinja."""
    kwargs = dict(template_kwargs)
    if template is not None:
        kwargs["chat_template"] = template
    try:
        return tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools is not None else None, add_generation_prompt=add_generation_prompt,
            tokenize=False, **kwargs,
        )
    except SecurityError as exc:
        if not _MUTATES.search(str(exc)):
            raise
        return _render_mutable(tokenizer, messages, tools, add_generation_prompt, template_kwargs, template)


_MUTATES = re.compile(r"attribute '\w+' of '(list|dict)' object is unsafe")


def _render_mutable(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    template_kwargs: Mapping[str, Any],
    template: str | None,
) -> str:
    """Render again where a template changes its own lists or dicts (Kimi-K2 queues its call ids with
    ``list.append`` / ``pop``): transformers' immutable sandbox refuses that, llama.cpp's minja and
    jinja's plain sandbox allow it. Written here because transformers has no switch for it: its own
    environment's filters and globals (``tojson``, ``raise_exception``, ``namespace`` ...) in jinja's
    plain sandbox, over JSON copies of the inputs, so a template changes only its copies."""
    from jinja2.sandbox import SandboxedEnvironment

    hf = hf_tokenizer(tokenizer)
    text = template if template is not None else chat_template(tokenizer)
    if text is None:  # a Python template (mlx-lm's) never raises the sandbox's error: nothing to render again
        raise TemplateError(
            "The chat template changes its own lists, which chatkit renders from its jinja text: pass that text "
            "with ChatSession.builder(...).chat_template(text_or_path)."
        )
    base = jinja_environment(text)
    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters.update(base.filters)
    env.globals.update(base.globals)
    data = json.loads(json.dumps({
        "messages": [{k: v for k, v in m.items() if v is not None} for m in messages],  # as transformers drops None
        "tools": list(tools) if tools is not None else None,
        "kwargs": {**hf.special_tokens_map, **template_kwargs},
    }))
    options = data["kwargs"]
    options.setdefault("enable_thinking", bool(getattr(tokenizer, "has_thinking", False)))  # as mlx-lm's wrapper
    return env.from_string(text).render(
        messages=data["messages"], tools=data["tools"], add_generation_prompt=add_generation_prompt, **options
    )


class PromptEncoder:
    """Rendered prompt text to token ids for one tokenizer (see the module docstring).

    ``protect(text)`` makes message content safe to render; ``encode(text)`` encodes a rendering
    (placeholders as literal text); ``reveal(text)`` gives a rendering's real text. Not thread-safe:
    one encoder per session.
    """

    def __init__(self, tokenizer: Any, *, allow_special_in_content: bool = False) -> None:
        hf = hf_tokenizer(tokenizer)
        self._backend = getattr(hf, "backend_tokenizer", None)
        self._hf = hf
        added = self._backend.get_added_tokens_decoder() if self._backend is not None else {}
        # Every added token splits text; the special ones are what content must not produce.
        self._added = {t.content: i for i, t in added.items()}
        specials = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)
        if len(specials) > _LAST - _FIRST:
            specials = specials[: _LAST - _FIRST]
        self._protect = allow_special_in_content is False and bool(specials)
        self._code = {s: chr(_FIRST + i) for i, s in enumerate(specials)}
        self._literal = {c: s for s, c in self._code.items()}
        self._literal[chr(_FIRST - 1)] = _MARK  # a marker already in content is escaped too
        self._specials_re = re.compile("|".join(map(re.escape, [_MARK, *specials])))
        self._placeholder_re = re.compile(re.escape(_MARK) + "(.)", re.DOTALL)
        self._added_re = re.compile("|".join(map(re.escape, sorted(self._added, key=len, reverse=True))) or "(?!)")
        self._text_backends: tuple[Any, Any] | None = None
        # The last encoding: its text, ids, and for each added token in it (char start, id index).
        self._last_text = ""
        self._last_ids: list[int] = []
        self._bounds: list[tuple[int, int]] = []

    # -- content ------------------------------------------------------------------------------------
    def protect(self, text: str) -> str:
        """``text`` with every special-token string replaced by a placeholder (identity when allowed)."""
        if not self._protect or not self._specials_re.search(text):
            return text
        return self._specials_re.sub(lambda m: _MARK + (self._code.get(m.group()) or chr(_FIRST - 1)), text)

    def reveal(self, text: str) -> str:
        """A rendering with its placeholders turned back into the literal strings."""
        if _MARK not in text:
            return text
        return self._placeholder_re.sub(lambda m: self._literal.get(m.group(1), m.group()), text)

    # -- encoding -----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of a rendering; the template writes its own special tokens (BOS included)."""
        if self._backend is None:  # a slow tokenizer: no incremental path
            return list(self._hf.encode(self.reveal(text), add_special_tokens=False))
        start, kept = self._reusable(text)
        if start < len(text) // 2:
            start, kept = self._adopt_recent(text, start, kept)
        tail_ids, tail_bounds = self._encode_from(text, start)
        ids = self._last_ids[:kept] + tail_ids
        self._bounds = [b for b in self._bounds if b[0] < start] + [(start + c, kept + i) for c, i in tail_bounds]
        self._last_text, self._last_ids = text, ids
        with _RECENT_LOCK:
            mine = _RECENT.setdefault(self._hf, {}).setdefault(self._protect, deque(maxlen=4))
            mine.append((text, ids, self._bounds))
        return list(ids)

    def _adopt_recent(self, text: str, start: int, kept: int) -> tuple[int, int]:
        """Start from the recent encoding (any session's, same tokenizer and settings) that shares the most
        with ``text``, when it shares more than this encoder's own last one: a new session whose long
        instructions another session sent encodes only its own messages."""
        with _RECENT_LOCK:
            recent = list(_RECENT.get(self._hf, {}).get(self._protect, ()))
        for old in recent:
            at, n = self._reusable(text, old[0], old[2])
            if at > start:
                start, kept = at, n
                self._last_text, self._last_ids, self._bounds = old
        return start, kept

    def continue_from(self, other: PromptEncoder) -> None:
        """Remember ``other``'s last encoding (same tokenizer and settings): a fork encodes only what is new."""
        self._last_text, self._last_ids, self._bounds = other._last_text, other._last_ids, other._bounds

    def encode_fresh(self, text: str) -> list[int]:
        """As :meth:`encode`, without reusing anything (for checks)."""
        return self._encode_from(text, 0)[0]

    def _reusable(self, text: str, old: str | None = None, bounds: list[tuple[int, int]] | None = None) -> tuple[int, int]:
        """(char start, id count) of the last added token whose whole self and everything before it
        are shared with the last text (or ``old``, whose added tokens are at ``bounds``); (0, 0) when
        nothing is."""
        if old is None or bounds is None:
            old, bounds = self._last_text, self._bounds
        lo, hi = 0, len(bounds)  # bounds[:lo] are known shared; find the first that is not
        while lo < hi:
            mid = (lo + hi) // 2
            char, index = bounds[mid]
            end = char + len(self._added_token_at(old, char))
            if end <= len(text) and text.startswith(old[:end]):
                lo = mid + 1
            else:
                hi = mid
        return bounds[lo - 1] if lo else (0, 0)

    def _added_token_at(self, text: str, char: int) -> str:
        match = self._added_re.match(text, char)
        return match.group() if match else ""

    def _encode_from(self, text: str, start: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of ``text[start:]`` (``start`` is 0 or an added token's start) and the (char, id index)
        of each added token in it, relative to ``start``."""
        tail = text[start:]
        assert self._backend is not None
        if _MARK not in tail:
            encoding = self._backend.encode(tail, add_special_tokens=False)
            ids, offsets, added = encoding.ids, encoding.offsets, self._added
            bounds = [(b, i) for i, (t, (b, e)) in enumerate(zip(ids, offsets)) if added.get(tail[b:e]) == t]
            return list(ids), bounds
        return self._encode_sections(tail, first=start == 0)

    def _encode_sections(self, text: str, *, first: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of a text with placeholders: split at the added tokens the template wrote, as the
        tokenizer would, and encode each section between them with special tokens read as text."""
        ids: list[int] = []
        bounds: list[tuple[int, int]] = []
        at = 0
        for match in [*self._added_re.finditer(text), None]:
            end = match.start() if match is not None else len(text)
            if end > at:
                ids.extend(self._encode_text(self.reveal(text[at:end]), first=first and at == 0))
            if match is None:
                break
            bounds.append((match.start(), len(ids)))
            ids.append(self._added[match.group()])
            at = match.end()
        return ids, bounds

    def _encode_text(self, section: str, *, first: bool) -> list[int]:
        """A section's ids with special-token strings read as text. A section after an added token is
        not the start of the input: a "prepend at the start" pre-tokenizer must not prepend there."""
        if self._text_backends is None:
            self._text_backends = (_text_backend(self._backend, prepend=True), _text_backend(self._backend, prepend=False))
        backend = self._text_backends[0 if first else 1]
        return list(backend.encode(section, add_special_tokens=False).ids)


def _text_backend(backend: Any, *, prepend: bool) -> Any:
    """A copy of a ``tokenizers`` backend that reads special tokens as text; with ``prepend=False``,
    a Metaspace pre-tokenizer's "first" scheme becomes "never" (the section is not the input's start)."""
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    if not prepend:
        _no_first_prepend(spec.get("pre_tokenizer"))
        _no_first_prepend(spec.get("normalizer"))
    copied = Tokenizer.from_str(json.dumps(spec))
    copied.encode_special_tokens = True
    return copied


def _no_first_prepend(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
        for value in node.values():
            _no_first_prepend(value)
    elif isinstance(node, list):
        for value in node:
            _no_first_prepend(value)


__all__ = ["PromptEncoder", "apply_chat_template"]
