"""The tokenizer's llguidance view, built once per loaded tokenizer (not per turn)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import llguidance
import llguidance.hf

from ..errors import InvalidOutputSpecError
from ..model.tokenizer import hf_tokenizer

_views: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def llg_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer`` (an mlx-lm ``TokenizerWrapper`` or a fast Hugging Face
    tokenizer), with the wrapper's end-of-sequence ids. Cached on the tokenizer object: building it
    walks the whole vocabulary (~0.1 s on the test tokenizers, ~1 s on 150k-token ones)."""
    with _lock:
        view = _views.get(tokenizer)
        if view is None:
            view = _views[tokenizer] = _build(tokenizer)
        return view


def _build(tokenizer: Any) -> llguidance.LLTokenizer:
    hf = hf_tokenizer(tokenizer)
    eos = getattr(tokenizer, "eos_token_ids", None) or getattr(hf, "eos_token_id", None)
    if isinstance(eos, (set, frozenset, list, tuple)):
        eos = sorted(int(i) for i in eos)
    try:
        return llguidance.hf.from_tokenizer(hf, eos_token=eos)
    except ValueError as e:
        raise InvalidOutputSpecError(
            f"Guided generation needs a fast (tokenizers-backed) tokenizer; this model has a "
            f"{type(hf).__name__}: {e}. Load the model with its tokenizer.json."
        ) from e


__all__ = ["llg_tokenizer"]
