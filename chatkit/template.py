"""Rendering a conversation to prompt token ids with the model's chat template or an override.

Rendering goes through the Hugging Face tokenizer's ``apply_chat_template`` (jinja2 in an immutable
sandbox, with transformers' hardening), so the model's own template and an override take one path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import TemplateError
from .messages import ChatMessage


def read_template(source: str | os.PathLike[str]) -> str:
    """The template text of ``source``: a path to a ``.jinja`` file, or the template itself."""
    if isinstance(source, os.PathLike):
        path = Path(source)
    elif isinstance(source, str):
        if "{{" in source or "{%" in source:
            return source
        path = Path(source)
    else:
        raise TemplateError(f"A chat template is a str or a path, got {type(source).__name__}.")
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(
            f"Could not read chat template file {str(path)!r}: {exc.strerror or exc}. "
            "Pass the template text itself or the path of an existing file."
        ) from exc


@dataclass(frozen=True)
class ChatTemplate:
    """Renders messages for one tokenizer. ``template`` overrides the tokenizer's own when given."""

    tokenizer: Any  # mlx-lm TokenizerWrapper or a Hugging Face tokenizer
    template: str | None = None

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; ``TemplateError`` if the template is missing or fails."""
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        if self.template is None and not getattr(hf, "chat_template", None):
            raise TemplateError(
                "This tokenizer has no chat template: pass one with "
                "ChatSession.builder(...).chat_template(text_or_path)."
            )
        try:
            text = hf.apply_chat_template(
                [m.to_dict() for m in messages],
                tools=list(tools) if tools else None,
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 syntax/runtime errors, raise_exception(), bad kwargs
            raise TemplateError(f"The chat template failed to render: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError(f"The chat template rendered a {type(text).__name__}, not text.")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; the template writes its own special tokens (BOS included)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


__all__ = ["ChatTemplate", "read_template"]
