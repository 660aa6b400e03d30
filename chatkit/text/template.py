"""Rendering a conversation to prompt token ids with the model's chat template or an override.

Rendering goes through mlx-lm's ``TokenizerWrapper.apply_chat_template`` (the thinking switch, Python
templates) and the Hugging Face tokenizer's (jinja2 in an immutable sandbox, with transformers'
hardening), so the model's own template and an override take one path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import TemplateError
from ..messages import ChatMessage, check_text
from ..model import tokenizer as _tokenizer
from .capabilities import Capabilities, adapt, probe, warn_dropped_tool_messages, warn_ignored_tools
from .encoder import PromptEncoder, apply_chat_template
from .reply import written_calls


def read_template(source: str | os.PathLike[str]) -> str:
    """The template text of ``source``: a path to a ``.jinja`` file, or the template itself."""
    if isinstance(source, os.PathLike):
        path = Path(source)
    elif isinstance(source, str):
        if "{{" in source or "{%" in source:
            check_text("The chat template", source, TemplateError)  # else every turn fails in the tokenizer
            return source
        path = Path(source)
    else:
        raise TemplateError(f"A chat template is a str or a path, got {type(source).__name__}.")
    try:
        if path.exists() and not path.is_file():  # a FIFO or device: reading it would block
            raise OSError(f"{str(path)!r} is not a regular file")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeError) as exc:  # UnicodeError: a path that is not UTF-8, or a file that is not
        raise TemplateError(
            f"Could not read chat template file {str(path)!r}: {getattr(exc, 'strerror', None) or exc}. "
            "Pass the template text itself or the path of an existing file."
        ) from exc


class ChatTemplate:
    """Renders a session's messages for one tokenizer and encodes the result.

    ``template`` overrides the tokenizer's own. Message content is tokenized as text: a special-token
    string inside it stays text unless ``allow_special_in_content`` (see ``chatkit.text.encoder``).
    One per session (the encoder remembers the last prompt, to encode only what is new).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, *, allow_special_in_content: bool = False) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.allow_special_in_content = allow_special_in_content
        self._encoder = PromptEncoder(tokenizer, allow_special_in_content=allow_special_in_content)
        self._warned: set[str] = set()

    def continue_from(self, other: ChatTemplate) -> None:
        """Encode only what is new after ``other``'s last prompt (a fork's template, same tokenizer)."""
        if other.tokenizer is self.tokenizer and other.allow_special_in_content == self.allow_special_in_content:
            self._encoder.continue_from(other._encoder)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; ``TemplateError`` if the template is missing or fails."""
        return self._encoder.reveal(self._render(messages, tools, add_generation_prompt, template_kwargs))

    def encode(
        self,
        messages: Sequence[ChatMessage],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        rewrite: Callable[[str], str] | None = None,
    ) -> list[int]:
        """The prompt's token ids; the template writes its own special tokens (BOS included). ``rewrite``
        changes what the template wrote before it is tokenized (a vision model's image markers)."""
        text = self._render(messages, tools, add_generation_prompt, template_kwargs)
        return self._encoder.encode(text if rewrite is None else rewrite(text))

    def capabilities(self) -> Capabilities:
        """What this template renders (probed once per template text; see ``chatkit.text.capabilities``)."""
        return _probe_for(self.tokenizer, self.template)

    def _render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        if self.template is None and not _tokenizer.has_chat_template(self.tokenizer):
            raise TemplateError(
                "This tokenizer has no chat template: pass one with "
                "ChatSession.builder(...).chat_template(text_or_path)."
            )
        dicts = [_template_dict(m, self._encoder.protect) for m in messages]
        caps = self.capabilities()
        warn_ignored_tools(caps, tools, self._warned)
        warn_dropped_tool_messages(caps, dicts, self._warned)
        dicts = adapt(dicts, caps, lambda calls: written_calls(self.tokenizer, calls))
        try:
            text = apply_chat_template(
                self.tokenizer,
                dicts,
                tools=list(tools) if tools else caps.no_tools,
                add_generation_prompt=add_generation_prompt,
                template=self.template,
                template_kwargs=template_kwargs or {},
            )
        except Exception as exc:  # jinja2 syntax/runtime errors, raise_exception(), bad kwargs
            raise TemplateError(f"The chat template failed to render: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):
            raise TemplateError(f"The chat template rendered a {type(text).__name__}, not text.")
        return text


_CAPABILITIES: dict[Any, Capabilities] = {}  # per template text: probing renders a few small conversations


def _probe_for(tokenizer: Any, template: str | None) -> Capabilities:
    key = template or _tokenizer.chat_template(tokenizer) or id(tokenizer)
    if key not in _CAPABILITIES:

        def render(dicts: list[dict[str, Any]], tools: Any) -> str:
            return apply_chat_template(
                tokenizer, dicts, tools=tools, add_generation_prompt=False, template=template, template_kwargs={}
            )

        _CAPABILITIES[key] = probe(render)
    return _CAPABILITIES[key]


def _template_dict(message: ChatMessage, protect: Callable[[str], str]) -> dict[str, Any]:
    """A message as chat templates read it, with every text the model sees protected (special-token
    strings stay text). Reasoning goes under both names templates read: ``reasoning_content`` (Qwen3,
    DeepSeek, MiniMax) and ``thinking`` (gpt-oss); empty fields are left out."""
    d = message.to_dict()
    d["content"] = protect(message.content)
    if message.images:  # content parts, as vision templates read them: the images, then the text
        d["content"] = [*({"type": "image"} for _ in message.images), {"type": "text", "text": d["content"]}]
    if message.reasoning is not None:
        d["reasoning_content"] = d["thinking"] = protect(message.reasoning)
    if message.tool_calls:
        d["tool_calls"] = [
            {**c.to_dict(), "function": {"name": protect(c.name), "arguments": _protect_json(c.arguments, protect)}}
            for c in message.tool_calls
        ]
    return d


def _protect_json(value: Any, protect: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return protect(value)
    if isinstance(value, Mapping):
        return {protect(str(k)): _protect_json(v, protect) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_protect_json(v, protect) for v in value]
    return value


__all__ = ["ChatTemplate", "read_template"]
