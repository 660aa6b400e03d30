"""Every contact chatkit has with mlx-lm's ``TokenizerWrapper`` and the Hugging Face tokenizer under it
(private attributes included: ``tests/test_mlx_contract.py`` pins them). Outside ``chatkit/cache/_mlx.py``
(the cache classes), this is the only module that touches private names of mlx-lm or transformers."""

from __future__ import annotations

import copy
import importlib
import pkgutil
import re
import threading
import weakref
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper


def hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer under an mlx-lm ``TokenizerWrapper`` (or the tokenizer itself)."""
    # Only a wrapper is unwrapped: a Hugging Face fast tokenizer keeps its Rust one in _tokenizer too.
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def wrap(tokenizer: Any) -> TokenizerWrapper:
    """An mlx-lm ``TokenizerWrapper`` around a Hugging Face tokenizer (as is, if it is one already)."""
    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def vocabulary(tokenizer: Any) -> dict[str, int]:
    return dict(hf_tokenizer(tokenizer).get_vocab())


def vocab_size(tokenizer: Any) -> int:
    """How many token ids the tokenizer knows (added tokens included)."""
    return len(hf_tokenizer(tokenizer))


def chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's own chat template text, if it has one."""
    template = getattr(hf_tokenizer(tokenizer), "chat_template", None)
    return template if isinstance(template, str) and template else None


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer can render chats: a jinja template, or mlx-lm's Python renderer."""
    return chat_template(tokenizer) is not None or getattr(tokenizer, "_chat_template", None) is not None


def jinja_environment(template: str) -> Any:
    """The jinja environment transformers renders ``template`` in, with its filters and globals
    (``tojson``, ``raise_exception``, ``namespace`` ...); transformers offers no public way to it."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).environment


def silence_length_warning(tokenizer: Any) -> None:
    """Sessions check the context window themselves (``ContextWindowExceededError``): transformers'
    "sequence length is longer than the specified maximum" warning would only be noise."""
    warnings = getattr(hf_tokenizer(tokenizer), "deprecation_warnings", None)
    if isinstance(warnings, dict):
        warnings["sequence-length-is-longer-than-the-specified-maximum"] = True


def new_detokenizer(tokenizer: Any) -> Any:
    """A streaming detokenizer of this turn's own (the wrapper's is one object shared by every session
    over the model), whose text is what the tokens decode to."""
    shared = tokenizer._detokenizer
    detokenizer = copy.copy(shared)  # shares the read-only token map, not the text
    if type(shared) is BPEStreamingDetokenizer:
        detokenizer.__class__ = _BPEDetokenizer
    detokenizer.reset()
    return detokenizer


def tool_parser_types() -> list[str]:
    """The tool-call formats mlx-lm has a parser for (``mlx_lm/tool_parsers/<name>.py``), by name."""
    import mlx_lm.tool_parsers as parsers

    return sorted(m.name for m in pkgutil.iter_modules(parsers.__path__) if not m.name.startswith("_"))


def tool_parser_module(name: str) -> Any:
    """mlx-lm's tool parser module ``name`` (``parse_tool_call``, ``tool_call_start``, ``tool_call_end``),
    as ``load(..., tool_parser_type=name)`` uses it; ``ValueError`` naming the known ones otherwise."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]{1,64}", name) or name not in tool_parser_types():
        shown = repr(name)[:60] if isinstance(name, str) else f"a {type(name).__name__}"
        raise ValueError(f"{shown} is not a tool-call format mlx-lm knows (one of: {', '.join(tool_parser_types())})")
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    if not all(hasattr(module, a) for a in ("parse_tool_call", "tool_call_start", "tool_call_end")):
        raise ValueError(f"mlx-lm's tool parser {name!r} is not a tool-call format (no parse_tool_call and markers)")
    return module


def tool_parser_type(tokenizer: Any) -> str | None:
    """The name of the mlx-lm tool-call format ``tokenizer`` reads (``None``: none, or not known by name)."""
    own = getattr(tokenizer, "_chatkit_tool_parser_type", None)  # a view (with_tool_parser)
    if own is not None:
        return str(own)
    kwargs = getattr(hf_tokenizer(tokenizer), "init_kwargs", None)  # where mlx-lm's load records the name
    name = kwargs.get("tool_parser_type") if isinstance(kwargs, dict) else None
    return name if isinstance(name, str) and getattr(tokenizer, "has_tool_calling", False) else None


_VIEWS: weakref.WeakKeyDictionary[Any, dict[str, TokenizerWrapper]] = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def with_tool_parser(tokenizer: TokenizerWrapper, name: str | None) -> TokenizerWrapper:
    """``tokenizer`` reading and writing tool calls in mlx-lm's format ``name`` (as if loaded with
    ``tool_parser_type=name``): a view sharing everything else (the Hugging Face tokenizer, the
    detokenizer, the template), one per (tokenizer, name). ``None`` or the format it has: ``tokenizer``."""
    if name is None or tool_parser_type(tokenizer) == name:
        return tokenizer
    module = tool_parser_module(name)
    with _views_lock:  # one view per (tokenizer, name): forks and restored sessions share their prompts' encoding
        views = _VIEWS.setdefault(tokenizer, {})
        if name not in views:
            view = copy.copy(tokenizer)  # mlx-lm keeps the tool format in private fields its constructor sets
            start, end = module.tool_call_start, module.tool_call_end
            view._tool_parser, view._tool_call_start, view._tool_call_end = module.parse_tool_call, start, end
            view._tool_call_start_tokens = tuple(tokenizer.encode(start, add_special_tokens=False))
            view._tool_call_end_tokens = tuple(tokenizer.encode(end, add_special_tokens=False))
            view._chatkit_tool_parser_type = name
            views[name] = view
        return views[name]


class _BPEDetokenizer(BPEStreamingDetokenizer):
    """mlx-lm's byte-level BPE detokenizer drops a reply's leading space (``decode`` keeps it) and holds
    a lone space back until the next token (an empty chunk on plain ASCII text). A reply must be
    committed as what its tokens decode to, or it re-tokenizes differently and is re-prefilled next
    turn; and text that is final is handed out at once."""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self._unflushed += self.tokenmap[token] if token < len(self.tokenmap) else "!"
        text = self._decode_bytes(self._unflushed)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self.text += text
            self._unflushed = ""

    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


__all__ = [
    "chat_template",
    "has_chat_template",
    "hf_tokenizer",
    "jinja_environment",
    "new_detokenizer",
    "silence_length_warning",
    "tool_parser_module",
    "tool_parser_type",
    "tool_parser_types",
    "vocab_size",
    "vocabulary",
    "with_tool_parser",
    "wrap",
]
