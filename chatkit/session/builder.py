"""``ChatSessionBuilder``: a session's settings, checked at ``build()``, including a cache to restore.

The builder knows the session only through the factory ``ChatSession.builder`` hands it: it collects
:class:`SessionSettings` (plain data) and the factory makes the session from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from ..cache.prompt import PromptCache
from ..cache.state import CacheOptions, CacheState
from ..decode import ProgressCallback
from ..decode.speculative import SpeculativeConfig, check_draft
from ..errors import InvalidMessageError, InvalidParamsError, SpeculativeCacheRestoreError
from ..messages import ChatMessage, MessageLike, Role, as_messages, check_instructions
from ..model import tokenizer as _tokenizer
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..model.switchable import ActiveAdapter, activate
from ..params import GenerateParams
from ..text.template import read_template
from ..tools import as_tools
from ..tools.options import DEFAULT_MAX_TOOL_ROUNDS, DEFAULT_TOOL_TIMEOUT, ToolOptions
from . import saved
from .context import ContextPolicy, Window
from .tool_loop import strict_grammar

S = TypeVar("S")


@dataclass(frozen=True)
class SessionSettings:
    """Everything a session is made from: what a builder collected and checked (``cache``: a restored
    cache to start from)."""

    lm: LoadedModel
    instructions: str | None = None
    history: tuple[ChatMessage, ...] = ()
    generate_params: GenerateParams | None = None
    chat_template: str | None = None
    tools: Sequence[Any] | None = None
    tool_options: ToolOptions = ToolOptions()
    cache_options: CacheOptions = CacheOptions()
    prefill_progress: ProgressCallback | None = None
    speculative: SpeculativeConfig | None = None
    allow_special_in_content: bool = False
    engine: Any = None
    context_policy: ContextPolicy = ContextPolicy()
    cache: CacheState | None = None
    window: Window = Window()  # what the model sees of ``history`` (a restored context policy's window)
    earlier: tuple[tuple[int, Window], ...] = ()
    adapter: ActiveAdapter | None = None  # the LoRA adapter applied to the model, checked and installed
    prompt_cache: PromptCache | None | str = "default"  # "default": the model's process-wide one
    max_kv_bytes: int | None = None  # the KV cache's budget: the window becomes the tokens that fit


def tool_tokenizer(lm: LoadedModel, adapter: ActiveAdapter | None) -> Any:
    """The tokenizer a session renders and reads replies with: ``lm``'s, reading tool calls in the
    format its adapter was trained to write when the adapter records one (``Adapter.tool_parser_type``);
    other sessions over ``lm`` keep the model's."""
    return _tokenizer.with_tool_parser(lm.tokenizer, None if adapter is None else adapter.adapter.tool_parser_type)


def _as_loaded(model: LoadedModel | Any, tokenizer: Any) -> LoadedModel:
    if isinstance(model, LoadedModel):
        if tokenizer is not None:
            raise InvalidParamsError("Pass a LoadedModel alone, or a model and its tokenizer, not both.")
        return model
    if isinstance(model, tuple) and len(model) == 2 and tokenizer is None:
        model, tokenizer = model  # what mlx_lm.load returns
    if tokenizer is None or not callable(model):
        raise InvalidParamsError(
            "builder() takes chatkit.load(...)'s result, or an mlx-lm model and its tokenizer."
        )
    if not all(callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")):
        raise InvalidParamsError(
            f"builder() takes an mlx-lm model and its tokenizer; got a {type(tokenizer).__name__} as the tokenizer."
        )
    tokenizer = _tokenizer.wrap(tokenizer)
    args = getattr(model, "args", None)
    config = dict(vars(args)) if args is not None and hasattr(args, "__dict__") else {}
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, source="")


class ChatSessionBuilder(Generic[S]):
    """Collects a session's settings; :meth:`build` checks them and returns the ``ChatSession``.

    A sharded model needs no builder option: the sharding belongs to the loaded weights, so
    ``chatkit.load(path, distributed="tensor" | "pipeline" | "auto")`` is the option, and a builder
    over that ``LoadedModel`` makes a session that runs in lockstep on every rank (docs/distributed.md).
    """

    def __init__(self, model: LoadedModel | Any, tokenizer: Any = None, *, factory: Callable[[SessionSettings], S]) -> None:
        """Prefer ``ChatSession.builder(model)``, which hands the builder its factory."""
        self._factory = factory
        self._lm = _as_loaded(model, tokenizer)
        self._instructions: str | None = None
        self._history: list[ChatMessage] = []
        self._params: GenerateParams | None = None
        self._template: str | None = None
        self._tools: Sequence[Any] | None = None
        self._tool_options = ToolOptions()
        self._cache_options: dict[str, Any] = {}
        self._progress: ProgressCallback | None = None
        self._restore: tuple[Any, bool] | None = None
        self._speculative: SpeculativeConfig | None = None
        self._allow_special = False
        self._engine: Any = None
        self._max_kv_bytes: int | None = None
        self._context_policy: ContextPolicy | None = None  # None: the default, or a restored file's
        self._adapter: ActiveAdapter | None = None
        self._prompt_cache: PromptCache | None | str = "default"

    def instructions(self, text: str | None) -> ChatSessionBuilder[S]:
        """The system prompt."""
        self._instructions = check_instructions(text)
        return self

    def history(self, messages: Iterable[MessageLike]) -> ChatSessionBuilder[S]:
        """Earlier messages to continue from. A leading system message becomes the instructions."""
        self._history = as_messages(messages)
        return self

    def generate_params(self, params: GenerateParams) -> ChatSessionBuilder[S]:
        if not isinstance(params, GenerateParams):
            raise InvalidParamsError(f"generate_params takes a GenerateParams, got {type(params).__name__}.")
        self._params = params
        return self

    def chat_template(self, template: str | os.PathLike[str]) -> ChatSessionBuilder[S]:
        """Use this jinja template (its text or a file path) instead of the tokenizer's own."""
        self._template = read_template(template)
        return self

    def tools(
        self,
        tools: Sequence[Any] | None,
        *,
        tool_execution: str = "auto",
        max_tool_rounds: int = DEFAULT_MAX_TOOL_ROUNDS,
        errors: str = "return",
        strict_tools: bool = False,
        tool_timeout: float | None = DEFAULT_TOOL_TIMEOUT,
    ) -> ChatSessionBuilder[S]:
        """Tools the model may call: Python functions (sync or async; the schema from the signature,
        type hints and docstring) or OpenAI-style JSON schema dicts, passed to the template as ``tools``, and
        ``chatkit.MCPServer`` s, which stand for their tools (listed here, within ``tool_timeout``).

        With ``tool_execution="auto"`` ``respond`` calls them and gives the results back to the model until
        it answers without calls (at most ``max_tool_rounds`` rounds of results, then ``ToolLoopLimitError``);
        ``"manual"`` leaves the calls to the app (``session.pending_tool_calls``). A failing call is told
        to the model as its result unless ``errors="raise"`` (``ToolExecutionError``).

        ``strict_tools=True`` constrains every tool call to the tools' schemas (the guided extra): text
        and reasoning stay free, but once the model opens a call its JSON must name one of the tools and
        fit that tool's parameters (closed objects), so a malformed call cannot be produced.
        ``InvalidOutputSpecError`` here for a tool-call format or a schema that cannot be constrained.

        Each call runs on a thread of its own and fails after ``tool_timeout`` seconds (default 60;
        ``None``: no limit): the model is told it timed out (with ``errors="raise"``:
        ``ToolExecutionError``). Closing the stream (``close()``, also from another thread) while a
        tool runs does not wait for it, and an async loop (``astream_respond``, ``arespond``) that is
        cancelled or closed stops waiting too: the calls are answered as stopped and the loop ends.
        An async tool that times out or is stopped is cancelled; a sync function cannot be
        interrupted, so its thread is abandoned: it runs on (a daemon thread) until the function
        returns, and its result is dropped. A tool that must run on the caller's thread (e.g. one
        using a sqlite3 connection made there) should open what it needs itself.
        """
        options = ToolOptions(tool_execution, max_tool_rounds, errors, strict_tools, tool_timeout)
        options.validate()
        checked = as_tools(tools, options.timeout)  # an MCPServer's tools listed within the tool timeout
        if strict_tools and checked is not None:
            strict_grammar(tool_tokenizer(self._lm, self._adapter), checked)
        self._tools, self._tool_options = checked, options
        return self

    def max_kv_size(self, tokens: int | None) -> ChatSessionBuilder[S]:
        """Keep at most this many tokens in a rotating KV cache."""
        self._cache_options["max_kv_size"] = tokens
        return self

    def max_kv_bytes(self, n: int | None) -> ChatSessionBuilder[S]:
        """A memory budget for this session's KV cache, in bytes: its window becomes the tokens that fit
        (``kv_bytes_per_token``, never more than the model's), and the context policy works at that window."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidParamsError(f"max_kv_bytes({n!r}): use an int of bytes >= 1, or None.")
        self._max_kv_bytes = n
        return self

    def kv_bits(self, bits: int | None, *, group_size: int = 64, start: int = 0) -> ChatSessionBuilder[S]:
        """Quantize the KV cache to ``bits`` once it holds ``start`` tokens."""
        self._cache_options.update(kv_bits=bits, kv_group_size=group_size, quantized_kv_start=start)
        return self

    def prompt_cache(self, cache: PromptCache | None) -> ChatSessionBuilder[S]:
        """Share KV blocks through ``cache`` (a ``chatkit.PromptCache``); ``None`` turns the prompt cache off
        for this session. Without this call a session uses its model's process-wide prompt cache (RAM
        only). See docs/caching.md."""
        if cache is not None and not isinstance(cache, PromptCache):
            raise InvalidParamsError(f"prompt_cache() takes a chatkit.PromptCache or None, got {type(cache).__name__}.")
        self._prompt_cache = cache
        return self

    def prefill_step_size(self, tokens: int) -> ChatSessionBuilder[S]:
        """Process prompts in chunks of this many tokens."""
        self._cache_options["prefill_step_size"] = tokens
        return self

    def prefill_progress(self, callback: ProgressCallback | None) -> ChatSessionBuilder[S]:
        """Called as ``callback(done, total)`` while a prompt is prefilled."""
        if callback is not None and not callable(callback):
            raise InvalidParamsError(f"prefill_progress() takes a callable (done, total) or None, got {type(callback).__name__}.")
        self._progress = callback
        return self

    def cache(self, source: str | os.PathLike[str] | Sequence[Any], *, verify: bool = True) -> ChatSessionBuilder[S]:
        """Restore a saved cache: a file from ``save_cache`` (conversation and cache) or a raw mlx-lm
        prompt cache (a file from ``save_prompt_cache`` or a list of cache layers).

        A raw cache becomes an opaque prefix: turns render the instructions and the session's messages
        after it. The layers are checked against the model, and a file's tensors against their
        checksums, unless ``verify=False``; chatkit files are always checked against the model's
        fingerprint. Settings given to this builder win over the
        file's (the transcript is the truth; the cache only saves work).
        """
        if not isinstance(source, (str, bytes, os.PathLike)) and not _is_layer_list(source):
            raise InvalidParamsError("cache() takes a file path or a list of mlx-lm cache layers.")
        if not isinstance(verify, bool):
            raise InvalidParamsError(f"cache(verify=...) takes True or False, got {verify!r}.")
        self._restore = (source, verify)
        return self

    def speculative(self, config: SpeculativeConfig | None) -> ChatSessionBuilder[S]:
        """Decode speculatively (``None`` turns it off). A draft model cannot be combined with
        :meth:`cache`; prompt lookup can."""
        if config is not None and not isinstance(config, SpeculativeConfig):
            raise InvalidParamsError(f"speculative() takes a SpeculativeConfig, got {type(config).__name__}.")
        self._speculative = config
        return self

    def allow_special_in_content(self, allow: bool = True) -> ChatSessionBuilder[S]:
        """Read special-token strings inside message content as the special tokens they name.

        Off by default: content is text, so a message holding e.g. ``<|im_end|>`` cannot forge a turn.
        Turn it on only for content the app itself writes and trusts.
        """
        if not isinstance(allow, bool):
            raise InvalidParamsError(f"allow_special_in_content takes a bool, got {type(allow).__name__}.")
        self._allow_special = allow
        return self

    def engine(self, engine: Any) -> ChatSessionBuilder[S]:
        """Decode this session's turns on a shared ``chatkit.BatchEngine`` (built over the same model),
        together with the other sessions' turns running at the same time; ``None``: alone."""
        self._engine = engine
        return self

    def context_policy(self, policy: ContextPolicy) -> ChatSessionBuilder[S]:
        """What a turn does when the conversation outgrows the context window (``chatkit.ContextPolicy``:
        ``error()``, the default, ``rolling(...)`` or ``summarize(...)``). The history keeps every message."""
        if not isinstance(policy, ContextPolicy):
            raise InvalidParamsError(f"context_policy() takes a chatkit.ContextPolicy, got {type(policy).__name__}.")
        self._context_policy = policy.checked()
        return self

    def adapter(self, adapter: Adapter | None, scale: float = 1.0) -> ChatSessionBuilder[S]:
        """Apply a LoRA/DoRA adapter (``chatkit.load_adapter(path)``) to this session's turns, at ``scale``
        times its own scale, over the model's one copy of the weights (``None``: the base model).
        ``ModelLoadError`` here if it does not fit the model; ``InvalidParamsError`` for something that is
        not an ``Adapter``, a bad scale or a sharded model. An adapter that records the tool-call format
        it was trained to write (``Adapter.tool_parser_type``) makes the session read its calls in that
        format. See docs/adapters.md."""
        active = activate(self._lm, adapter, scale)
        if self._tool_options.strict and self._tools is not None:
            strict_grammar(tool_tokenizer(self._lm, active), self._tools)  # the adapter's tool-call format
        self._adapter = active
        return self

    def build(self) -> S:
        """Check the settings (and load the cache to restore) and return the session."""
        instructions, history = self._instructions, list(self._history)
        if history and history[0].role is Role.SYSTEM:
            if instructions is not None:
                raise InvalidMessageError(
                    "Both instructions() and a leading system message in history(): give the system prompt once."
                )
            instructions, history = history[0].content, history[1:]
        if self._speculative is not None and self._speculative.draft_model is not None and self._restore is not None:
            # A draft model's cache is not in the file and cannot be rebuilt for a raw cache's opaque
            # prefix; prompt lookup has no cache of its own, so it restores like standard decoding.
            raise SpeculativeCacheRestoreError(
                "Speculative decoding with a draft model cannot start from a restored cache: drop "
                ".speculative(...) or .cache(...), or use SpeculativeConfig(draft=\"prompt_lookup\")."
            )
        if self._speculative is not None:
            check_draft(self._lm, self._speculative)
        options = CacheOptions(**self._cache_options)
        options.validate(self._lm.head_dim)
        params = self._params.copy() if self._params is not None else None
        if params is not None:
            params.validate()
        settings = SessionSettings(
            self._lm, instructions, tuple(history), params, self._template, self._tools, self._tool_options, options,
            self._progress, self._speculative, self._allow_special, self._engine, self._context_policy or ContextPolicy(),
            adapter=self._adapter, prompt_cache=self._prompt_cache, max_kv_bytes=self._max_kv_bytes,
        )
        return self._factory(settings if self._restore is None else self._restored(settings))

    def _restored(self, settings: SessionSettings) -> SessionSettings:
        """``settings`` with the cache to restore, and the file's conversation and settings where the
        builder was given none (the builder's win: the transcript is the truth, the cache only saves work)."""
        source, verify = self._restore  # type: ignore[misc]
        loaded = saved.load(self._lm, source, verify=verify, adapter=self._adapter)
        options = settings.cache_options
        if loaded.info.kind == "chatkit":
            conversation = saved.SavedConversation.of(loaded.info)
            if self._instructions is None and not self._history:
                settings = replace(settings, instructions=conversation.instructions)
            if not self._history:
                context = conversation.context
                settings = replace(settings, history=conversation.messages, window=context.window,
                                   earlier=context.earlier)
                if self._context_policy is None and context.policy is not None:
                    settings = replace(settings, context_policy=context.policy)
            if settings.generate_params is None and conversation.generate_params is not None:
                settings = replace(settings, generate_params=conversation.generate_params)
            options = self._saved_options(conversation.cache_options, options)
        cache = CacheState.restored(self._lm.model, options, loaded.layers, loaded.ledger, loaded.checkpoints)
        return replace(settings, cache_options=options, cache=cache)

    def _saved_options(self, saved_options: Any, options: CacheOptions) -> CacheOptions:
        """The file's cache options under the builder's; a rotating cache keeps its window."""
        if not saved_options:
            return options
        known = {k: v for k, v in saved_options.items() if k in CacheOptions.__dataclass_fields__}
        options = CacheOptions(**{**known, **self._cache_options})
        options.validate(self._lm.head_dim)
        if options.max_kv_size != known.get("max_kv_size"):
            # The layers are what they were saved as: a rotating cache cannot become unbounded
            # or change its window, so such a restore would silently keep the saved kind.
            raise InvalidParamsError(
                f"This file's cache was made with max_kv_size={known.get('max_kv_size')}, not "
                f"{options.max_kv_size}: restore it without .max_kv_size(...) (or with the same "
                "value), or start from its transcript with .history(...) instead of .cache(...)."
            )
        return options


def _is_layer_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(hasattr(c, "state") for c in value)


__all__ = ["ChatSessionBuilder", "SessionSettings"]
