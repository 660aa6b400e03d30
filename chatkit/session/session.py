"""``ChatSession``: a conversation with a model that reuses its KV cache from turn to turn.

A turn is a pipeline: render (template) -> plan and prefill (cache) -> stream (generation, stream)
-> commit (here). The session owns the history and the cache state and sequences the steps.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, overload

from .. import distributed
from ..cache import store
from ..cache.state import CacheInfo, CacheOptions, CacheState
from ..decode import TokenSource
from ..decode.batch import check_engine
from ..decode.sources import source_for
from ..decode.speculative import SpeculativeConfig, check_cache_options
from ..errors import (
    ChatKitError,
    InvalidMessageError,
    InvalidOutputSpecError,
    InvalidParamsError,
    MissingDependencyError,
    NoCacheAvailableError,
    NothingToRegenerateError,
    NothingToUndoError,
    SessionBusyError,
)
from ..messages import ChatMessage, MessageLike, Role, ToolCall, as_message, check_instructions, saved_dict
from ..model import tokenizer as _tokenizer
from ..model.loaded import LoadedModel
from ..params import GenerateParams, LogitsProcessor
from ..text.template import ChatTemplate
from ..tools import as_tools
from ..tools.options import ToolOptions
from .aio import AsyncGuidedStream, AsyncResponseStream
from .conversation import Conversation, pending_calls
from .streams import GuidedStream, ResponseStream, TurnResult, TurnStats
from .tool_loop import ToolLoopStream
from .turn import Prompting, Turn

if TYPE_CHECKING:
    from ..decode.batch import BatchEngine
    from .builder import ChatSessionBuilder

ProgressCallback = Callable[[int, int], None]
STOPPING_TURN_WAIT = 60.0  # seconds; a stopping async turn may still be finishing a prefill chunk


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
        self._strict: tuple[Any, Any] | None = None  # (tools, their strict call grammar), built on first use
        if tool_options.strict and self._tools is not None:
            self._strict_grammar()  # a format or schema that cannot be constrained raises here
        self._speculative = speculative
        self._engine = engine
        self._source: TokenSource = (
            engine.source(speculative) if engine is not None else source_for(lm.model, lm.distributed, speculative)
        )
        self._conversation = Conversation(history, self._new_cache(cache_options))
        self._progress = prefill_progress
        self._turn = threading.Lock()  # held from the start of a turn until it commits or aborts
        self._loop: _LoopHold | None = None  # an open tool loop holds the conversation between its rounds too
        self._async_stop: threading.Event | None = None  # set once the last async turn was told to stop
        self._last_stats: TurnStats | None = None
        self._guided: tuple[ChatMessage, dict[str, Any]] | None = None  # the last guided prompt and its spec

    @staticmethod
    def builder(model: LoadedModel | Any, tokenizer: Any = None) -> ChatSessionBuilder:
        """Start building a session over a loaded model (``chatkit.load``) or a model and tokenizer."""
        from .builder import ChatSessionBuilder  # the builder makes sessions: it imports this module

        return ChatSessionBuilder(model, tokenizer)

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
        with self._idle("change the instructions"):
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
        with self._idle("change the tools"):
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
        return self._turn.locked() or self._loop is not None

    def clear(self) -> None:
        """Forget the history and the cache (the instructions stay)."""
        with self._idle("clear the session"):
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
        with self._idle("change the cache options"):
            if options != self.cache_options:
                self._conversation = Conversation(self._conversation.messages, self._new_cache(options))

    def cache_info(self) -> CacheInfo:
        """What the KV cache holds now."""
        return self._conversation.cache.info()

    def release_cache(self) -> None:
        """Free the KV cache's memory; the next turn prefills the whole conversation again."""
        with self._idle("release the cache"):
            self._conversation.cache.reset()

    def save_cache(self, path: str | os.PathLike[str]) -> int:
        """Save the KV cache with the conversation to ``path`` (a ``.safetensors`` file), atomically.

        Restore it with ``ChatSession.builder(lm).cache(path).build()``, or into this session with
        :meth:`restore_cache`. Returns the file's size in bytes. ``NoCacheAvailableError`` before the
        first turn (or after ``clear``/``release_cache``). Over a sharded model every rank writes its
        own shard (rank r > 0 next to ``path``: ``chat.rank1.safetensors``) and fails if any rank fails.
        """
        with self._idle("save the cache"):
            cache = self._conversation.cache
            if cache.empty or cache.layers is None:
                raise NoCacheAvailableError("There is no KV cache to save yet: run a turn first.")
            layers = cache.layers
            return distributed.agree(self._lm.distributed, "save the cache", lambda: store.save(
                distributed.shard_path(self._lm.distributed, path),
                layers,
                cache.ledger,
                fingerprint=self._lm.fingerprint,
                instructions=self._instructions,
                messages=[saved_dict(m) for m in self._conversation.messages],
                generate_params=self._params.to_dict(),
                cache_options=asdict(cache.options),
                checkpoints=cache.checkpoints,
            ))

    def restore_cache(self, path: str | os.PathLike[str]) -> None:
        """Put back the KV cache of a file this session's conversation was saved to (e.g. by a pool
        that evicted it), checked against the model's fingerprint. The conversation itself stays as
        it is: turns reuse as much of the restored cache as matches it."""
        with self._idle("restore the cache"):
            def read(file: str | os.PathLike[str]) -> store.LoadedCache:
                saved = store.load(file)
                store.check_fingerprint(self._lm.fingerprint, saved.info.fingerprint, repr(str(file)))
                store.check_layers(self._lm.model, saved, repr(str(file)))
                return saved

            saved = distributed.restore(self._lm.distributed, path, read)
            options = self.cache_options
            # A draft's cache is not saved: it is refilled from the ledger at the next turn.
            cache = CacheState.restored(
                self._lm.model, options, saved.layers, saved.ledger, saved.checkpoints, self._draft_model
            )
            self._use_cache(cache)

    # -- editing --------------------------------------------------------------------------------
    def undo(self) -> list[ChatMessage]:
        """Drop the last exchange (the prompt and its reply; with automatic tools, the tool calls and
        results in between too, also of a tool loop that stopped before its answer), rewind the cache
        to match, and return it."""
        with self._idle("undo"):
            conversation = self._conversation
            tools = self._runs_tools()
            if not (conversation.ends_with_exchange() or tools and conversation.ends_with_tool_round()):
                raise NothingToUndoError("There is no exchange to undo: the history does not end with a reply.")
            start = conversation.exchange_start(tools)
            kept, dropped = conversation.messages[:start], list(conversation.messages[start:])
            try:
                ids = self._rendered_ids(kept)
            except ChatKitError:
                ids = []  # cannot render what is left: the cache rewinds as far as it can
            conversation.rewind(kept, ids)
            return dropped

    def regenerate(self) -> Any:
        """Answer the last prompt again, replacing the last reply; returns the new reply. A guided
        reply (``respond(..., output=...)``) is answered with the same spec again and its value returned.

        After an automatic tool loop the last prompt is the last tool result: only the final answer is
        generated again, from the same results (no tool runs again, and a call in the new reply is not
        run). To redo the whole exchange, ``undo()`` then ``respond()`` the prompt again. After a tool
        loop that stopped once its tools ran (closed, or failed), it answers their results.
        """
        with self.stream_regenerate() as stream:
            for _ in stream:
                pass
        return stream.value if isinstance(stream, GuidedStream) else stream.text

    def stream_regenerate(self) -> ResponseStream | GuidedStream:
        """As :meth:`regenerate`, streamed. The old reply is replaced when the new one commits."""
        strict = self._tool_options.strict and self._tools is not None
        if self._runs_tools() and self._conversation.ends_with_tool_round():
            return self._open_turn(None, strict=strict)  # the history's last message, a tool result, is answered
        history = self._conversation.messages
        if self._guided is not None and len(history) >= 2 and self._guided[0] == history[-2]:
            from ..guided.guide import guide  # the guided extra

            prompt, spec = self._guided  # the message as sent (its description appended already)
            render = lambda m: self._prompting().text([*history[:-2], m], self._params)  # noqa: E731
            _, constraint = guide(prompt, self.model.tokenizer, render, **spec, include_schema=False)
            return GuidedStream(self._open_turn(None, regenerate=True, constraint=constraint), constraint)
        return self._open_turn(None, regenerate=True, strict=strict)

    def fork(self) -> ChatSession:
        """An independent session with the same conversation, settings and a copy of the cache.

        The copy shares the cached prefix's memory until one of the two writes, so both branches go on
        without prefilling the past again.
        """
        with self._idle("fork"):
            other = ChatSession(
                self._lm,
                instructions=self._instructions,
                generate_params=self._params.copy(),
                chat_template=self._template.template,
                tools=self._tools,
                tool_options=self._tool_options,
                cache_options=self.cache_options,
                prefill_progress=self._progress,
                speculative=self._speculative,
                allow_special_in_content=self._template.allow_special_in_content,
                engine=self._engine,
            )
            other._conversation = self._conversation.copy()
            other._last_stats = self._last_stats
            other._guided = self._guided
            return other

    # -- turns --------------------------------------------------------------------------------
    def respond(
        self, prompt: str | MessageLike, *, role: Role | str = Role.USER, tool_call_id: str | None = None,
        output: Any = None, regex: str | None = None, grammar: str | None = None, include_schema: bool = True,
        strict_tools: bool | None = None,
    ) -> Any:
        """Send ``prompt`` and return the whole reply (with tools, the answer after the last tool round).
        With ``output=`` (a type or a JSON Schema), ``regex=`` or ``grammar=`` (Lark) the reply is
        constrained and its value is returned (:mod:`chatkit.guided`; ``IncompleteOutputError`` if
        ``max_tokens`` cut it short). ``strict_tools`` (default: the builder's) constrains tool calls to
        the tools' schemas (see ``builder.tools``)."""
        with self.stream_respond(prompt, role=role, tool_call_id=tool_call_id, output=output, regex=regex,
                                 grammar=grammar, include_schema=include_schema, strict_tools=strict_tools) as stream:
            for _ in stream:
                pass
        return stream.value if isinstance(stream, GuidedStream) else stream.text

    @overload
    def stream_respond(
        self, prompt: str | MessageLike, *, role: Role | str = ..., tool_call_id: str | None = ...,
        output: None = None, regex: None = None, grammar: None = None, include_schema: bool = ...,
        strict_tools: bool | None = ...,
    ) -> ResponseStream | ToolLoopStream: ...

    @overload
    def stream_respond(
        self, prompt: str | MessageLike, *, role: Role | str = ..., tool_call_id: str | None = ...,
        output: Any = ..., regex: str | None = ..., grammar: str | None = ..., include_schema: bool = ...,
        strict_tools: bool | None = ...,
    ) -> ResponseStream | ToolLoopStream | GuidedStream: ...

    def stream_respond(
        self, prompt: str | MessageLike, *, role: Role | str = Role.USER, tool_call_id: str | None = None,
        output: Any = None, regex: str | None = None, grammar: str | None = None, include_schema: bool = True,
        strict_tools: bool | None = None,
    ) -> ResponseStream | ToolLoopStream | GuidedStream:
        """Send ``prompt`` and return the reply as a stream of :class:`StreamChunk` s.

        ``prompt`` is the text of a message from ``role`` (user by default; tool results with
        ``Role.TOOL`` and the ``tool_call_id`` they answer), or a ``ChatMessage``/dict. Nothing runs
        until the stream is iterated. Without tools the stream is a :class:`ResponseStream` (one
        turn). With tools, or for a tool result, it is a :class:`ToolLoopStream` over every round (see
        ``builder.tools``): the same surface (``text``, ``reasoning``, ``tool_calls``, ``tokens``,
        ``finish_reason``, ``stats``, ``close``), plus ``rounds`` and ``tool_results``; a tool result
        while other calls of the same reply are still unanswered is added to the history and nothing
        is generated. With ``output=`` / ``regex=`` / ``grammar=`` it is one turn whose reply is a
        value (a ``chatkit.session.streams.GuidedStream`` with ``partial`` and ``value``; no tool round);
        ``include_schema`` appends the spec's description to a text prompt (the model then follows
        it with fewer forced tokens). ``strict_tools=True`` (default: the builder's ``strict_tools``)
        constrains every tool call of every round to the tools' schemas; ``False`` turns that off for
        this prompt.
        """
        if strict_tools is not None and not isinstance(strict_tools, bool):
            raise InvalidParamsError(f"strict_tools={strict_tools!r}: use True, False or None (the session's default).")
        message = _prompt_message(prompt, role, tool_call_id, self._conversation.messages)
        if strict_tools and _guided(output, regex, grammar):
            raise InvalidOutputSpecError(
                "strict_tools=True with output=/regex=/grammar=: a guided reply is a value and calls no tools. "
                "Drop one of them."
            )
        if strict_tools and self._tools is None:
            raise InvalidParamsError("strict_tools=True but the session has no tools: set them with builder.tools([...]).")
        strict = self._tool_options.strict if strict_tools is None else strict_tools
        if _guided(output, regex, grammar):
            from ..guided.guide import guide  # the guided extra

            message, constraint = guide(
                message, self.model.tokenizer, self.render, output=output, regex=regex, grammar=grammar,
                include_schema=include_schema,
            )
            stream = GuidedStream(self._open_turn(message, constraint=constraint), constraint)
            self._guided = (message, {"output": output, "regex": regex, "grammar": grammar})
            return stream
        plain = self._open_turn(message) if self._tools is None and message.role is not Role.TOOL else None
        opened = plain if plain is not None else self._tool_loop(message, strict=strict)
        self._guided = None  # the last reply is not guided: regenerate() answers it freely, even to the same text
        return opened

    def astream_respond(
        self, prompt: str | MessageLike, *, role: Role | str = Role.USER, tool_call_id: str | None = None,
        output: Any = None, regex: str | None = None, grammar: str | None = None, include_schema: bool = True,
        strict_tools: bool | None = None,
    ) -> AsyncResponseStream:
        """As :meth:`stream_respond`, for ``async for``: generation runs on a worker thread."""
        stop = threading.Event()  # stream_respond may still wait on the previous async turn's
        inner = self.stream_respond(prompt, role=role, tool_call_id=tool_call_id, output=output, regex=regex,
                                    grammar=grammar, include_schema=include_schema, strict_tools=strict_tools)
        if isinstance(inner, GuidedStream):
            stream: AsyncResponseStream = AsyncGuidedStream(inner, stop=stop)
        else:
            stream = AsyncResponseStream(inner, stop=stop)
        self._async_stop = stop
        return stream

    async def arespond(
        self, prompt: str | MessageLike, *, role: Role | str = Role.USER, tool_call_id: str | None = None,
        output: Any = None, regex: str | None = None, grammar: str | None = None, include_schema: bool = True,
        strict_tools: bool | None = None,
    ) -> Any:
        """As :meth:`respond`, without blocking the event loop. Cancelling it commits the reply so far."""
        async with self.astream_respond(prompt, role=role, tool_call_id=tool_call_id, output=output, regex=regex,
                                        grammar=grammar, include_schema=include_schema,
                                        strict_tools=strict_tools) as stream:
            async for _ in stream:
                pass
        return stream.value if isinstance(stream, AsyncGuidedStream) else stream.text

    def render(self, prompt: str | MessageLike | None = None, *, role: Role | str = Role.USER) -> str:
        """The prompt text the model would see if ``prompt`` were sent now (the template's output)."""
        history = self._conversation.messages
        if prompt is None:
            return self._prompting().text(history, self._params, add_generation_prompt=False)
        return self._prompting().text([*history, _prompt_message(prompt, role, history=history)], self._params)

    def _open_turn(
        self, message: ChatMessage | None, *, regenerate: bool = False, constraint: LogitsProcessor | None = None,
        strict: bool = False, loop: _LoopHold | None = None,
    ) -> ResponseStream:
        """Take the turn and prepare it: answer ``message`` after the history, or (``None``) the
        history's last message (a tool round), or (``regenerate``) the last prompt again; ``constraint``
        (guided output) masks every step after the session's own processors; ``strict`` constrains the
        reply's tool calls (after every other processor). The turn is held until the stream commits or
        aborts. ``loop``: the tool loop this turn is a round of."""
        params = self._params.copy()
        if constraint is not None:
            params = params.copy(logits_processors=[*params.logits_processors, constraint])
        params.validate(_vocab_size(self._lm, self._speculative))
        constraints = [self._strict_constraint(params)] if strict and self._tools is not None else []
        if not self._take_turn(loop):
            raise SessionBusyError("This session already has a turn in progress: finish or close its stream first.")
        try:
            base = self._conversation.messages
            if message is None and not regenerate:
                if not base or base[-1].role is Role.ASSISTANT:
                    raise NothingToRegenerateError("There is no message to answer: send a prompt.")
                base, message = base[:-1], base[-1]
            elif message is None:
                if not self._conversation.ends_with_exchange():
                    raise NothingToRegenerateError(
                        "There is no reply to regenerate: the history does not end with a reply."
                    )
                base, message = base[:-2], base[-2]
            tokenizer = self._lm.tokenizer
            turn = Turn.prepare(
                self._prompting(), self._conversation, base, message, params,
                context_length=self._lm.context_length,
                source=self._source,
                settle=self._settle,
                progress=self._progress,
                detokenizer=_tokenizer.new_detokenizer(tokenizer),
                eos_token_ids=frozenset(tokenizer.eos_token_ids),
                constraints=constraints,
            )
            return ResponseStream(turn)
        except BaseException:
            self._turn.release()
            raise

    def _settle(self, result: TurnResult | None) -> None:
        """A turn ended (committed with ``result``, or aborted): give the turn back."""
        if result is not None:
            self._last_stats = result.stats
        self._turn.release()

    def _tool_loop(self, message: ChatMessage, *, strict: bool = False) -> ToolLoopStream:
        """The rounds of a reply with tools (``chatkit.session.tool_loop``), over this session's turns; with
        ``strict`` every round's tool calls are constrained."""
        options, tools = self._tool_options, self._tools or []
        if strict and self._tools is not None:
            self._strict_grammar()  # before anything changes: a format or schema that cannot be constrained
        waiting = [c for c in pending_calls(self._conversation.messages) if c.id != message.tool_call_id]
        if message.role is Role.TOOL and waiting:  # more results to come: nothing to generate yet
            self._append([message])
            return ToolLoopStream(self._open_turn, self._append, tools, message, generate=False)
        hold = _LoopHold()
        with self._idle("start a reply"):
            self._loop = hold

        def end() -> None:
            if self._loop is hold:
                self._loop = None
            hold.ended.set()

        return ToolLoopStream(
            lambda m: self._open_turn(m, strict=strict, loop=hold), lambda ms: self._append(ms, loop=hold),
            tools, message, execute=self._runs_tools(), max_rounds=options.max_rounds,
            raise_errors=options.errors == "raise", on_end=end,
        )

    def _append(self, messages: Sequence[ChatMessage], loop: _LoopHold | None = None) -> None:
        """Tool results enter the history (the next round prefills them)."""
        with _Idle(self, "add tool results", loop):
            self._conversation.record([*self._conversation.messages, *messages], [])

    # -- internals ------------------------------------------------------------------------------
    def _runs_tools(self) -> bool:
        """Whether replies run an automatic tool loop (so an exchange spans its tool rounds)."""
        tools = self._tools or []
        return self._tool_options.execution == "auto" and any(t.function is not None for t in tools)

    def _strict_grammar(self) -> Any:
        """The strict tool-call grammar of the current tools (compiled once per tool set)."""
        tools = self._tools or []
        if self._strict is None or self._strict[0] is not tools:
            self._strict = (tools, strict_grammar(self._lm.tokenizer, tools))
        return self._strict[1]

    def _strict_constraint(self, params: GenerateParams) -> LogitsProcessor:
        from ..guided.call_grammar import ToolCallConstraint  # the guided extra (checked when the grammar was built)

        return ToolCallConstraint(self._strict_grammar(), self._lm.tokenizer, stop=params.stop)

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
        """Start from a restored cache (the builder's restore)."""
        cache.shared = self._shared_prefixes()
        self._conversation = Conversation(self._conversation.messages, cache)

    def _new_cache(self, options: CacheOptions) -> CacheState:
        cache = CacheState(self._lm.model, options, self._draft_model)
        cache.shared = self._shared_prefixes()
        return cache

    def _shared_prefixes(self) -> Any:
        """The engine's shared prefix cache, when the session runs on a ``BatchEngine`` that has one."""
        return None if self._engine is None else self._engine.prefix_cache

    def _take_turn(self, loop: _LoopHold | None = None) -> bool:
        """Take the turn lock, unless a tool loop other than ``loop`` holds the conversation. An async
        turn that was told to stop (cancelled, closed, or its stream dropped) commits on its worker
        within a decode step, and its tool loop ends after that round: wait for that rather than fail."""
        stop = self._async_stop
        stopping = stop is not None and stop.is_set()
        if not self._turn.acquire(blocking=False) and not (stopping and self._turn.acquire(timeout=STOPPING_TURN_WAIT)):
            return False
        holder = self._loop
        if holder is None or holder is loop:
            return True
        self._turn.release()
        return stopping and holder.ended.wait(STOPPING_TURN_WAIT) and self._take_turn(loop)

    def _idle(self, action: str) -> _Idle:
        return _Idle(self, action)


class _LoopHold:
    """An open tool loop's hold on its session; ``ended`` is set once the loop is over."""

    def __init__(self) -> None:
        self.ended = threading.Event()


class _Idle:
    """Holds the turn lock for a short edit; ``SessionBusyError`` while a stream is open (``loop``: the
    tool loop making the edit, which holds the session)."""

    def __init__(self, session: ChatSession, action: str, loop: _LoopHold | None = None) -> None:
        self._session, self._action, self._loop = session, action, loop

    def __enter__(self) -> None:
        if not self._session._take_turn(self._loop):
            raise SessionBusyError(f"Cannot {self._action} while a reply is streaming: close the stream first.")

    def __exit__(self, *exc_info: object) -> None:
        self._session._turn.release()


def strict_grammar(tokenizer: Any, tools: Sequence[Any]) -> Any:
    """The strict tool-call grammar of ``tools`` (``Tool`` s) for ``tokenizer``: ``InvalidOutputSpecError``
    for a format or a schema that cannot be constrained, ``MissingDependencyError`` without the guided extra."""
    try:
        from ..guided.call_grammar import tool_call_grammar
    except ImportError as e:
        raise MissingDependencyError(f"strict_tools needs the guided extra: pip install 'chatkit[guided]' ({e}).") from e
    return tool_call_grammar(tokenizer, [t.schema for t in tools])


def _guided(output: Any, regex: str | None, grammar: str | None) -> bool:
    return output is not None or regex is not None or grammar is not None


def _prompt_message(
    prompt: str | MessageLike, role: Role | str, tool_call_id: str | None = None, history: Sequence[ChatMessage] = ()
) -> ChatMessage:
    if isinstance(prompt, str):
        message = ChatMessage(Role.parse(role), prompt, tool_call_id=tool_call_id)
    elif isinstance(prompt, (ChatMessage, Mapping)):
        message = as_message(prompt)
    else:
        raise InvalidMessageError(f"A prompt is a str or a message, got {type(prompt).__name__}.")
    if not message.content.strip() and message.role is not Role.TOOL:  # a tool may well return nothing
        raise InvalidMessageError("The prompt is empty: send some text.")
    if message.role is Role.ASSISTANT:
        raise InvalidMessageError("A prompt cannot come from the assistant: use role user, tool or system.")
    if message.role is Role.TOOL:
        message = _answering(message, pending_calls(history))
    return message


def _vocab_size(lm: LoadedModel, speculative: SpeculativeConfig | None) -> int:
    """Token ids must be below this in every model a turn runs (mlx-lm biases the draft's logits too)."""
    draft = speculative.draft_model if speculative is not None else None
    return lm.vocab_size if draft is None else min(lm.vocab_size, draft.vocab_size)


def _answering(message: ChatMessage, pending: list[ToolCall]) -> ChatMessage:
    """A tool result with the id and name of the call it answers (the only pending call, if not given)."""
    if message.tool_call_id is None:
        if len(pending) > 1:
            raise InvalidMessageError(
                f"The last reply made {len(pending)} tool calls: say which one this answers with tool_call_id= "
                f"(one of {[c.id for c in pending]})."
            )
        if not pending:
            return message
        return replace(message, tool_call_id=pending[0].id, name=message.name or pending[0].name)
    call = next((c for c in pending if c.id == message.tool_call_id), None)
    if call is None:
        raise InvalidMessageError(
            f"No pending tool call has id {message.tool_call_id!r}: the pending ones are {[c.id for c in pending]}."
        )
    return replace(message, name=message.name or call.name)


__all__ = ["ChatSession"]
