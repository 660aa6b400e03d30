"""``ChatSessionBuilder``: a session's settings, checked at ``build()``, including a cache to restore.

The builder knows the session only through the factory ``ChatSession.builder`` hands it: it collects
:class:`~chatkit.SessionConfig` (one frozen value) with the history (and a cache to restore), and the factory
makes the session from them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, fields, replace
from typing import Any, Generic, TypeVar, cast

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
from .config import SessionConfig
from .context import ContextPolicy, Window
from .tool_loop import strict_grammar

S = TypeVar("S")


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

    def __init__(self, model: LoadedModel | Any, tokenizer: Any = None, *, factory: Callable[..., S]) -> None:
        """Prefer ``ChatSession.builder(model)``, which hands the builder its factory (``ChatSession._start``)."""
        self._factory = factory
        self._lm = _as_loaded(model, tokenizer)
        self._config = SessionConfig()
        self._given: set[str] = set()  # settings given here (a restored file's give way to them)
        self._history: list[ChatMessage] = []
        self._cache_options: dict[str, Any] = {}
        self._restore: tuple[Any, bool] | None = None

    def _set(self, **settings: Any) -> ChatSessionBuilder[S]:
        self._config = replace(self._config, **settings)
        self._given.update(settings)
        return self

    def config(self, config: SessionConfig) -> ChatSessionBuilder[S]:
        """Start from ``config`` (e.g. another session's ``session.config``): every setting at once; the
        methods called after it change single settings."""
        if not isinstance(config, SessionConfig):
            raise InvalidParamsError(f"config() takes a chatkit.SessionConfig, got {type(config).__name__}.")
        self._cache_options = asdict(config.cache_options)
        return self._set(**{f.name: getattr(config, f.name) for f in fields(config)})

    def instructions(self, text: str | None) -> ChatSessionBuilder[S]:
        """The system prompt."""
        return self._set(instructions=check_instructions(text))

    def history(self, messages: Iterable[MessageLike]) -> ChatSessionBuilder[S]:
        """Earlier messages to continue from. A leading system message becomes the instructions."""
        self._history = as_messages(messages)
        return self

    def generate_params(self, params: GenerateParams) -> ChatSessionBuilder[S]:
        if not isinstance(params, GenerateParams):
            raise InvalidParamsError(f"generate_params takes a GenerateParams, got {type(params).__name__}.")
        return self._set(generate_params=params)

    def chat_template(self, template: str | os.PathLike[str]) -> ChatSessionBuilder[S]:
        """Use this jinja template (its text or a file path) instead of the tokenizer's own."""
        return self._set(chat_template=read_template(template))

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
            strict_grammar(tool_tokenizer(self._lm, self._config.adapter), checked)
        return self._set(tools=None if checked is None else tuple(checked), tool_options=options)

    def max_kv_size(self, tokens: int | None) -> ChatSessionBuilder[S]:
        """Keep at most this many tokens in a rotating KV cache."""
        self._cache_options["max_kv_size"] = tokens
        return self

    def max_kv_bytes(self, n: int | None) -> ChatSessionBuilder[S]:
        """A memory budget for this session's KV cache, in bytes: its window becomes the tokens that fit
        (``kv_bytes_per_token``, never more than the model's), and the context policy works at that window."""
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidParamsError(f"max_kv_bytes({n!r}): use an int of bytes >= 1, or None.")
        return self._set(max_kv_bytes=n)

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
        return self._set(prompt_cache=cache)

    def prefill_step_size(self, tokens: int) -> ChatSessionBuilder[S]:
        """Process prompts in chunks of this many tokens."""
        self._cache_options["prefill_step_size"] = tokens
        return self

    def prefill_progress(self, callback: ProgressCallback | None) -> ChatSessionBuilder[S]:
        """Called as ``callback(done, total)`` while a prompt is prefilled."""
        if callback is not None and not callable(callback):
            raise InvalidParamsError(f"prefill_progress() takes a callable (done, total) or None, got {type(callback).__name__}.")
        return self._set(prefill_progress=callback)

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
        return self._set(speculative=config)

    def allow_special_in_content(self, allow: bool = True) -> ChatSessionBuilder[S]:
        """Read special-token strings inside message content as the special tokens they name.

        Off by default: content is text, so a message holding e.g. ``<|im_end|>`` cannot forge a turn.
        Turn it on only for content the app itself writes and trusts.
        """
        if not isinstance(allow, bool):
            raise InvalidParamsError(f"allow_special_in_content takes a bool, got {type(allow).__name__}.")
        return self._set(allow_special_in_content=allow)

    def engine(self, engine: Any) -> ChatSessionBuilder[S]:
        """Decode this session's turns on a shared ``chatkit.BatchEngine`` (built over the same model),
        together with the other sessions' turns running at the same time; ``None``: alone."""
        return self._set(engine=engine)

    def context_policy(self, policy: ContextPolicy) -> ChatSessionBuilder[S]:
        """What a turn does when the conversation outgrows the context window (``chatkit.ContextPolicy``:
        ``error()``, the default, ``rolling(...)`` or ``summarize(...)``). The history keeps every message."""
        if not isinstance(policy, ContextPolicy):
            raise InvalidParamsError(f"context_policy() takes a chatkit.ContextPolicy, got {type(policy).__name__}.")
        return self._set(context_policy=policy.checked())

    def adapter(self, adapter: Adapter | None, scale: float = 1.0) -> ChatSessionBuilder[S]:
        """Apply a LoRA/DoRA adapter (``chatkit.load_adapter(path)``) to this session's turns, at ``scale``
        times its own scale, over the model's one copy of the weights (``None``: the base model).
        ``ModelLoadError`` here if it does not fit the model; ``InvalidParamsError`` for something that is
        not an ``Adapter``, a bad scale or a sharded model. An adapter that records the tool-call format
        it was trained to write (``Adapter.tool_parser_type``) makes the session read its calls in that
        format. See docs/adapters.md."""
        active = activate(self._lm, adapter, scale)
        if self._config.tool_options.strict and self._config.tools is not None:
            strict_grammar(tool_tokenizer(self._lm, active), self._config.tools)  # the adapter's tool-call format
        return self._set(adapter=active)

    def build(self) -> S:
        """Check the settings (and load the cache to restore) and return the session."""
        config, history = self._config, list(self._history)
        if history and history[0].role is Role.SYSTEM:
            if config.instructions is not None:
                raise InvalidMessageError(
                    "Both instructions() and a leading system message in history(): give the system prompt once."
                )
            config, history = replace(config, instructions=history[0].content), history[1:]
        speculative = config.speculative
        if speculative is not None and speculative.draft_model is not None and self._restore is not None:
            # A draft model's cache is not in the file and cannot be rebuilt for a raw cache's opaque
            # prefix; prompt lookup has no cache of its own, so it restores like standard decoding.
            raise SpeculativeCacheRestoreError(
                "Speculative decoding with a draft model cannot start from a restored cache: drop "
                ".speculative(...) or .cache(...), or use SpeculativeConfig(draft=\"prompt_lookup\")."
            )
        if speculative is not None:
            check_draft(self._lm, speculative)
        options = CacheOptions(**self._cache_options)
        options.validate(self._lm.head_dim)
        config.generate_params.validate()
        config = replace(config, cache_options=options, generate_params=config.generate_params.copy())
        if self._restore is None:
            return self._factory(self._lm, config, history)
        return self._factory(self._lm, *self._restored(config, history))

    def _restored(self, config: SessionConfig, history: list[ChatMessage]) -> tuple[Any, ...]:
        """(config, history, the cache to restore, window, earlier windows): the file's conversation and
        settings where the builder was given none (the builder's win: the transcript is the truth, the
        cache only saves work)."""
        source, verify = self._restore  # type: ignore[misc]
        loaded = saved.load(self._lm, source, verify=verify, adapter=config.adapter)
        window, earlier = Window(), cast(tuple[tuple[int, Window], ...], ())
        if loaded.info.kind == "chatkit":
            conversation = saved.SavedConversation.of(loaded.info)
            keep: set[str] = {name for name in ("generate_params", "context_policy", *saved.SETTINGS) if name in self._given}
            if self._history:  # (a leading system message in it gave the instructions)
                keep |= {"instructions", "history", "context_policy"}
            elif self._config.instructions is not None:
                keep.add("instructions")
            config = conversation.onto(config, keep)
            if "history" not in keep:
                history, window, earlier = list(conversation.messages), conversation.context.window, conversation.context.earlier
            config = replace(config, cache_options=self._saved_options(conversation.cache_options, config.cache_options))
        cache = CacheState.restored(self._lm.model, config.cache_options, loaded.layers, loaded.ledger, loaded.checkpoints)
        return config, history, cache, window, earlier

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


__all__ = ["ChatSessionBuilder"]
