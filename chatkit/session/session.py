"""``ChatSession``: a conversation with a model that reuses its KV cache from turn to turn.

A turn is a pipeline: render (template) -> plan and prefill (cache) -> stream (generation, stream)
-> commit (here). The session owns the history and the cache state and sequences the steps; every
turn method is one entry (:meth:`ChatSession.stream_respond`: the options checked once, then the turn
opened), of which the others are short wrappers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from typing_extensions import Unpack

from ..cache.state import CacheInfo, CacheOptions, CacheState
from ..decode import ProgressCallback, TokenSource
from ..decode.batch import BatchEngine, check_engine
from ..decode.sources import source_for
from ..decode.speculative import SpeculativeConfig, check_cache_options, vocab_limit
from ..errors import InvalidParamsError, NoCacheAvailableError
from ..messages import ChatMessage, MessageLike, Role, ToolCall, check_instructions
from ..model import tokenizer as _tokenizer
from ..model.loaded import LoadedModel
from ..params import GenerateParams, LogitsProcessor
from ..text.template import ChatTemplate
from ..tools import as_tools
from ..tools.options import ToolOptions
from . import saved
from .aio import AsyncGuidedStream, AsyncResponseStream
from .builder import ChatSessionBuilder, SessionSettings
from .conversation import Conversation, pending_calls
from .gate import LoopHold, TurnGate
from .options import TurnKeywords, TurnOptions
from .streams import GuidedStream, ReplyStream, ResponseStream, TurnResult, TurnStats, drain
from .tool_loop import StrictCalls, ToolLoopStream, strict_grammar
from .turn import Prompting, Turn


class ChatSession:
    """A stateful conversation with one model. Build it with :meth:`ChatSession.builder`.

    One turn at a time: while a stream is open (with tools, until the loop's answer), starting another
    turn, ``clear()`` or editing the conversation raises ``SessionBusyError`` and changes nothing.
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        instructions: str | None = None,
        history: Sequence[ChatMessage] = (),
        generate_params: GenerateParams | None = None,
        chat_template: str | None = None,
        tools: Sequence[Any] | None = None,
        tool_options: ToolOptions = ToolOptions(),
        cache_options: CacheOptions = CacheOptions(),
        prefill_progress: ProgressCallback | None = None,
        speculative: SpeculativeConfig | None = None,
        allow_special_in_content: bool = False,
        engine: BatchEngine | None = None,
    ) -> None:
        """Prefer :meth:`builder`, which also restores saved caches; every argument is checked here."""
        if not isinstance(lm, LoadedModel):
            raise InvalidParamsError(f"A session needs a chatkit.load(...) result, got {type(lm).__name__}.")
        check_engine(engine, lm.model)
        cache_options.validate(lm.head_dim)
        check_cache_options(speculative, cache_options)
        self._lm = lm
        self._template = ChatTemplate(lm.tokenizer, chat_template, allow_special_in_content=allow_special_in_content)
        self._instructions = check_instructions(instructions)
        self._params = generate_params if generate_params is not None else GenerateParams()
        self._tools = as_tools(tools)
        tool_options.validate()
        self._tool_options = tool_options
        self._strict = StrictCalls(lm.tokenizer)
        if tool_options.strict and self._tools is not None:
            self._strict.grammar(self._tools)  # a format or schema that cannot be constrained raises here
        self._speculative = speculative
        self._engine = engine
        self._source: TokenSource = (
            engine.source(speculative) if engine is not None else source_for(lm.model, lm.distributed, speculative)
        )
        self._conversation = Conversation(history, self._new_cache(cache_options))
        self._progress = prefill_progress
        self._gate = TurnGate()
        self._last_stats: TurnStats | None = None
        self._guided: tuple[ChatMessage, dict[str, Any]] | None = None  # the last guided prompt and its spec

    @staticmethod
    def builder(model: LoadedModel | Any, tokenizer: Any = None) -> ChatSessionBuilder[ChatSession]:
        """Start building a session over a loaded model (``chatkit.load``) or a model and tokenizer."""
        return ChatSessionBuilder(model, tokenizer, factory=ChatSession._from_settings)

    @classmethod
    def _from_settings(cls, s: SessionSettings) -> ChatSession:
        """The session a builder's settings describe (the factory ``builder()`` hands the builder)."""
        session = cls(s.lm, **{f.name: getattr(s, f.name) for f in fields(s) if f.name not in ("lm", "cache")})
        if s.cache is not None:
            session._use_cache(s.cache)
        return session

    # -- conversation state -------------------------------------------------------------------
    @property
    def model(self) -> LoadedModel:
        return self._lm

    @property
    def history(self) -> list[ChatMessage]:
        """The conversation so far (without the instructions), as a copy."""
        return list(self._conversation.messages)

    @property
    def instructions(self) -> str | None:
        """The system prompt, rendered at the start of every turn's prompt; ``None`` for none."""
        return self._instructions

    @instructions.setter
    def instructions(self, value: str | None) -> None:
        with self._gate.idle("change the instructions"):
            self._instructions = check_instructions(value)

    @property
    def generate_params(self) -> GenerateParams:
        """The sampling settings; mutate them or assign new ones, they apply from the next turn."""
        return self._params

    @generate_params.setter
    def generate_params(self, value: GenerateParams) -> None:
        if not isinstance(value, GenerateParams):
            raise InvalidParamsError(f"generate_params must be a GenerateParams, got {type(value).__name__}.")
        self._params = value

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """Tool JSON schemas passed to the chat template every turn (set functions or schema dicts)."""
        return None if self._tools is None else [dict(t.schema) for t in self._tools]

    @tools.setter
    def tools(self, value: Sequence[Any] | None) -> None:
        tools = as_tools(value)
        if self._tool_options.strict and tools is not None:
            strict_grammar(self._lm.tokenizer, tools)  # raises before anything changes
        with self._gate.idle("change the tools"):
            self._tools = tools

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """The calls of the last reply that no tool message answers yet (answer them with
        ``respond(result, role=Role.TOOL, tool_call_id=call.id)`` in manual mode)."""
        return pending_calls(self._conversation.messages)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The draft model setup, when decoding is speculative."""
        return self._speculative

    @property
    def engine(self) -> BatchEngine | None:
        """The ``BatchEngine`` this session's turns are decoded by, if any."""
        return self._engine

    @property
    def last_stats(self) -> TurnStats | None:
        """``TurnStats`` of the last committed turn."""
        return self._last_stats

    @property
    def busy(self) -> bool:
        """Whether a turn is in progress (a stream is open; with tools, until its last round ends)."""
        return self._gate.busy

    def clear(self) -> None:
        """Forget the history and the cache (the instructions stay)."""
        with self._gate.idle("clear the session"):
            self._conversation.clear()

    # -- the cache ----------------------------------------------------------------------------
    @property
    def cache_options(self) -> CacheOptions:
        """How the KV cache is built; assigning new options rebuilds the cache at the next turn."""
        return self._conversation.cache.options

    @cache_options.setter
    def cache_options(self, options: CacheOptions) -> None:
        if not isinstance(options, CacheOptions):
            raise InvalidParamsError(f"cache_options must be a CacheOptions, got {type(options).__name__}.")
        options.validate(self._lm.head_dim)
        check_cache_options(self._speculative, options)
        with self._gate.idle("change the cache options"):
            if options != self.cache_options:
                self._conversation = Conversation(self._conversation.messages, self._new_cache(options))

    def cache_info(self) -> CacheInfo:
        """What the KV cache holds now."""
        return self._conversation.cache.info()

    def release_cache(self) -> None:
        """Free the KV cache's memory; the next turn prefills the whole conversation again."""
        with self._gate.idle("release the cache"):
            self._conversation.cache.reset()

    def save_cache(self, path: str | os.PathLike[str]) -> int:
        """Save the KV cache with the conversation to ``path`` (a ``.safetensors`` file), atomically.

        Restore it with ``ChatSession.builder(lm).cache(path).build()``, or into this session with
        :meth:`restore_cache`. Returns the file's size in bytes. ``NoCacheAvailableError`` before the
        first turn (or after ``clear``/``release_cache``). Over a sharded model every rank writes its
        own shard (rank r > 0 next to ``path``: ``chat.rank1.safetensors``) and fails if any rank fails.
        """
        with self._gate.idle("save the cache"):
            cache = self._conversation.cache
            if cache.empty or cache.layers is None:
                raise NoCacheAvailableError("There is no KV cache to save yet: run a turn first.")
            conversation = saved.SavedConversation(self._instructions, self._conversation.messages, self._params, None)
            return saved.save(path, self._lm, cache.layers, cache.ledger, cache.checkpoints, conversation, cache.options)

    def restore_cache(self, path: str | os.PathLike[str]) -> None:
        """Put back the KV cache of a file this session's conversation was saved to (e.g. by a pool
        that evicted it), checked against the model's fingerprint. The conversation itself stays as
        it is: turns reuse as much of the restored cache as matches it."""
        with self._gate.idle("restore the cache"):
            loaded = saved.load(self._lm, path, raw=False)
            # A draft's cache is not saved: it is refilled from the ledger at the next turn.
            self._use_cache(CacheState.restored(
                self._lm.model, self.cache_options, loaded.layers, loaded.ledger, loaded.checkpoints, self._draft_model
            ))

    # -- editing --------------------------------------------------------------------------------
    def undo(self) -> list[ChatMessage]:
        """Drop the last exchange (the prompt and its reply; with automatic tools, the tool calls and
        results in between too, also of a tool loop that stopped before its answer), rewind the cache
        to match, and return it."""
        with self._gate.idle("undo"):
            return self._conversation.undo(self._runs_tools(), self._rendered_ids)

    def regenerate(self) -> Any:
        """Answer the last prompt again, replacing the last reply; returns the new reply. A guided
        reply (``respond(..., output=...)``) is answered with the same spec again and its value returned.

        After an automatic tool loop the last prompt is the last tool result: only the final answer is
        generated again, from the same results (no tool runs again, and a call in the new reply is not
        run). To redo the whole exchange, ``undo()`` then ``respond()`` the prompt again. After a tool
        loop that stopped once its tools ran (closed, or failed), it answers their results.
        """
        return drain(self.stream_regenerate())

    def stream_regenerate(self) -> ReplyStream:
        """As :meth:`regenerate`, streamed. The old reply is replaced when the new one commits."""
        strict = self._tool_options.strict and self._tools is not None
        if self._runs_tools() and self._conversation.ends_with_tool_round():
            return self._open_turn(None, strict=strict)  # the history's last message, a tool result, is answered
        history = self._conversation.messages
        if self._guided is not None and len(history) >= 2 and self._guided[0] == history[-2]:
            from ..guided.guide import guide  # the guided extra

            prompt, spec = self._guided  # the message as sent (its description appended already)

            def render(message: ChatMessage) -> str:
                return self._prompting().text([*history[:-2], message], self._params)

            _, constraint = guide(prompt, self.model.tokenizer, render, **spec, include_schema=False, params=self._params)
            return GuidedStream(self._open_turn(None, regenerate=True, constraint=constraint), constraint)
        return self._open_turn(None, regenerate=True, strict=strict)

    def fork(self) -> ChatSession:
        """An independent session with the same conversation, settings and a copy of the cache.

        The copy shares the cached prefix's memory until one of the two writes, so both branches go on
        without prefilling the past again.
        """
        with self._gate.idle("fork"):
            other = ChatSession._from_settings(SessionSettings(
                self._lm, self._instructions, (), self._params.copy(), self._template.template, self._tools,
                self._tool_options, self.cache_options, self._progress, self._speculative,
                self._template.allow_special_in_content, self._engine,
            ))
            other._conversation = self._conversation.copy()
            other._last_stats = self._last_stats
            other._guided = self._guided
            return other

    # -- turns --------------------------------------------------------------------------------
    def respond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> Any:
        """Send ``prompt`` and return the whole reply (with tools, the answer after the last tool round;
        with ``output=`` / ``regex=`` / ``grammar=``, its value). The options are
        :meth:`stream_respond`'s."""
        return drain(self.stream_respond(prompt, **options))

    def stream_respond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> ReplyStream:
        """Send ``prompt`` and return the reply as a stream of :class:`StreamChunk` s.

        ``prompt`` is the text of a message from ``role`` (user by default; tool results with
        ``Role.TOOL`` and the ``tool_call_id`` they answer), or a ``ChatMessage``/dict. Nothing runs
        until the stream is iterated. Without tools the stream is a ``ResponseStream`` (one turn). With
        tools, or for a tool result, it is a ``ToolLoopStream`` over every round (see
        ``builder.tools``), with ``rounds`` and ``tool_results``; a tool result while other calls of
        the same reply are still unanswered is added to the history and nothing is generated.

        With ``output=`` (a type or a JSON Schema), ``regex=`` or ``grammar=`` (Lark) the reply is
        constrained and is a value (a ``GuidedStream`` with ``partial`` and ``value``; no tool round;
        ``IncompleteOutputError`` if ``max_tokens`` cut it short); ``include_schema`` appends the spec's
        description to a text prompt. ``strict_tools=True`` (default: the builder's ``strict_tools``)
        constrains every tool call of every round to the tools' schemas; ``False`` turns that off for
        this prompt. Every option is checked before anything changes (:class:`TurnOptions`).
        """
        checked = TurnOptions.of(options)
        message = checked.message(prompt, self._conversation.messages)
        if checked.strict_tools and self._tools is None:
            raise InvalidParamsError("strict_tools=True but the session has no tools: set them with builder.tools([...]).")
        if checked.guided:
            return self._guided_turn(message, checked)
        strict = self._tool_options.strict if checked.strict_tools is None else checked.strict_tools
        plain = self._open_turn(message) if self._tools is None and message.role is not Role.TOOL else None
        opened = plain if plain is not None else self._tool_loop(message, strict=strict)
        self._guided = None  # the last reply is not guided: regenerate() answers it freely, even to the same text
        return opened

    def astream_respond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> AsyncResponseStream:
        """As :meth:`stream_respond`, for ``async for``: generation runs on a worker thread."""
        stop = threading.Event()  # stream_respond may still wait on the previous async turn's
        inner = self.stream_respond(prompt, **options)
        kind = AsyncGuidedStream if isinstance(inner, GuidedStream) else AsyncResponseStream
        stream = kind(inner, stop=stop)  # type: ignore[arg-type]
        self._gate.async_stop = stop
        return stream

    async def arespond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> Any:
        """As :meth:`respond`, without blocking the event loop. Cancelling it commits the reply so far."""
        async with self.astream_respond(prompt, **options) as stream:
            async for _ in stream:
                pass
        return stream.result()

    def render(self, prompt: str | MessageLike | None = None, *, role: Role | str = Role.USER) -> str:
        """The prompt text the model would see if ``prompt`` were sent now (the template's output)."""
        history = self._conversation.messages
        if prompt is None:
            return self._prompting().text(history, self._params, add_generation_prompt=False)
        return self._prompting().text([*history, TurnOptions(role=role).message(prompt, history)], self._params)

    def _guided_turn(self, message: ChatMessage, options: TurnOptions) -> GuidedStream:
        """A turn whose reply is a value (``chatkit.guided``, an extra): the spec's constraint masks it."""
        from ..guided.guide import guide  # the guided extra

        message, constraint = guide(message, self.model.tokenizer, self.render, **options.spec,
                                    include_schema=options.include_schema, params=self._params)
        stream = GuidedStream(self._open_turn(message, constraint=constraint), constraint)
        self._guided = (message, options.spec)
        return stream

    def _open_turn(
        self, message: ChatMessage | None, *, regenerate: bool = False, constraint: LogitsProcessor | None = None,
        strict: bool = False, loop: LoopHold | None = None,
    ) -> ResponseStream:
        """Take the turn and prepare it: answer ``message`` after the history, or (``None``) the
        history's last message (a tool round), or (``regenerate``) the last prompt again; ``constraint``
        (guided output) masks every step after the session's own processors; ``strict`` constrains the
        reply's tool calls (after every other processor). The turn is held until the stream commits or
        aborts. ``loop``: the tool loop this turn is a round of."""
        params = self._params.copy()
        if constraint is not None:
            params = params.copy(logits_processors=[*params.logits_processors, constraint])
        params.validate(vocab_limit(self._lm, self._speculative))
        constraints = [self._strict.constraint(self._tools, params.stop)] if strict and self._tools is not None else []
        self._gate.take_turn(loop)
        try:
            base, message = self._conversation.prompt_of(message, regenerate)
            tokenizer = self._lm.tokenizer
            turn = Turn.prepare(
                self._prompting(), self._conversation, base, message, params,
                context_length=self._lm.context_length, source=self._source, settle=self._settle,
                progress=self._progress, detokenizer=_tokenizer.new_detokenizer(tokenizer),
                eos_token_ids=frozenset(tokenizer.eos_token_ids), constraints=constraints,
            )
            return ResponseStream(turn)
        except BaseException:
            self._gate.release()
            raise

    def _settle(self, result: TurnResult | None) -> None:
        """A turn ended (committed with ``result``, or aborted): give the turn back."""
        if result is not None:
            self._last_stats = result.stats
        self._gate.release()

    def _tool_loop(self, message: ChatMessage, *, strict: bool = False) -> ToolLoopStream:
        """The rounds of a reply with tools (``tool_loop``), over this session's turns; with ``strict``
        every round's tool calls are constrained."""
        options, tools = self._tool_options, self._tools or []
        if strict and self._tools is not None:
            self._strict.grammar(self._tools)  # before anything changes: a format or schema that cannot be constrained
        waiting = [c for c in pending_calls(self._conversation.messages) if c.id != message.tool_call_id]
        if message.role is Role.TOOL and waiting:  # more results to come: nothing to generate yet
            self._append([message])
            return ToolLoopStream(self._open_turn, self._append, tools, message, generate=False)
        hold = self._gate.hold()
        return ToolLoopStream(
            lambda m: self._open_turn(m, strict=strict, loop=hold), lambda ms: self._append(ms, loop=hold),
            tools, message, execute=self._runs_tools(), max_rounds=options.max_rounds,
            raise_errors=options.errors == "raise", timeout=options.timeout, on_end=lambda: self._gate.let_go(hold),
        )

    def _append(self, messages: Sequence[ChatMessage], loop: LoopHold | None = None) -> None:
        """Tool results enter the history (the next round prefills them)."""
        with self._gate.idle("add tool results", loop):
            self._conversation.record([*self._conversation.messages, *messages], [])

    # -- internals ------------------------------------------------------------------------------
    def _runs_tools(self) -> bool:
        """Whether replies run an automatic tool loop (so an exchange spans its tool rounds)."""
        tools = self._tools or []
        return self._tool_options.execution == "auto" and any(t.function is not None for t in tools)

    def _prompting(self) -> Prompting:
        schemas = None if self._tools is None else [t.schema for t in self._tools]
        return Prompting(self._template, self._instructions, schemas)

    def _rendered_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The ids of ``messages`` as a finished conversation (no generation prompt)."""
        if not messages and self._instructions is None:
            return []
        return self._prompting().ids(messages, self._params, add_generation_prompt=False)

    @property
    def _draft_model(self) -> Any:
        draft = self._speculative.draft_model if self._speculative is not None else None
        return draft.model if draft is not None else None

    def _use_cache(self, cache: CacheState) -> None:
        """Go on from a restored cache."""
        cache.shared = self._shared_prefixes()
        self._conversation = Conversation(self._conversation.messages, cache)

    def _new_cache(self, options: CacheOptions) -> CacheState:
        cache = CacheState(self._lm.model, options, self._draft_model)
        cache.shared = self._shared_prefixes()
        return cache

    def _shared_prefixes(self) -> Any:
        """The engine's shared prefix cache, when the session runs on a ``BatchEngine`` that has one."""
        return None if self._engine is None else self._engine.prefix_cache


__all__ = ["ChatSession"]
