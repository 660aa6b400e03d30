"""Every contact chatkit has with mlx-lm's ``TokenizerWrapper`` and the Hugging Face tokenizer under it
(private attributes included: ``tests/test_mlx_contract.py`` pins them). Outside ``chatkit/cache/_mlx.py``
(the cache classes), this is the only module that touches private names of mlx-lm or transformers."""

from __future__ import annotations

import copy
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
    "vocab_size",
    "vocabulary",
    "wrap",
]
