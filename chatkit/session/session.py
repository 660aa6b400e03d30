"""``ChatSession``: a conversation with a model that reuses its KV cache from turn to turn.

A turn is a pipeline: render (template) -> plan and prefill (cache) -> stream (generation, stream)
-> commit (here). The session owns the history and the cache state and sequences the steps; every
turn method is one entry (:meth:`ChatSession.stream_respond`: the options checked once, then the turn
opened), of which the others are short wrappers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from typing_extensions import Unpack

from ..cache.prompt import PromptCache
from ..cache.state import CacheInfo, CacheOptions, CacheState
from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig, check_cache_options, vocab_limit
from ..errors import InvalidMessageError, InvalidParamsError, NoCacheAvailableError
from ..messages import ChatMessage, MessageLike, Role, ToolCall, as_messages, check_instructions
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..model.switchable import activate
from ..params import GenerateParams
from ..tools import as_tools
from . import saved
from .aio import AsyncGuidedStream, AsyncResponseStream
from .builder import ChatSessionBuilder
from .config import SessionConfig
from .context import ContextPolicy, system_text, window_size
from .conversation import Conversation, pending_calls
from .core import SessionCore
from .options import TurnKeywords, TurnOptions, checked_params, prompt_messages
from .results import TurnStats
from .streams import GuidedStream, ReplyStream, drain
from .tool_loop import strict_grammar
from .turn import fitted


class ChatSession(SessionCore):
    """A stateful conversation with one model. Build it with :meth:`ChatSession.builder`.

    One turn at a time: while a stream is open (with tools, until the loop's answer), starting another
    turn, ``clear()`` or editing the conversation raises ``SessionBusyError`` and changes nothing.
    """


    @staticmethod
    def builder(model: LoadedModel | Any, tokenizer: Any = None) -> ChatSessionBuilder[ChatSession]:
        """Start building a session over a loaded model (``chatkit.load``) or a model and tokenizer."""
        return ChatSessionBuilder(model, tokenizer, factory=ChatSession._start)


    # -- conversation state -------------------------------------------------------------------
    @property
    def model(self) -> LoadedModel:
        return self._lm

    @property
    def config(self) -> SessionConfig:
        """This session's settings, one frozen ``SessionConfig`` (its ``generate_params`` a copy: mutating it
        changes nothing). The setters below (``instructions``, ``generate_params``, ...) replace it; a turn's
        own ``params=`` never change it. ``ChatSession(lm, dataclasses.replace(session.config, ...))`` builds
        a new session with changed settings."""
        return replace(self._config, generate_params=self._config.generate_params.copy())

    @property
    def history(self) -> list[ChatMessage]:
        """The conversation so far (without the instructions), as a copy."""
        return list(self._conversation.messages)

    @property
    def instructions(self) -> str | None:
        """The system prompt, rendered at the start of every turn's prompt; ``None`` for none."""
        return self._config.instructions

    @instructions.setter
    def instructions(self, value: str | None) -> None:
        with self._gate.idle("change the instructions"):
            self._config = replace(self._config, instructions=check_instructions(value))

    @property
    def generate_params(self) -> GenerateParams:
        """The sampling settings; mutate them or assign new ones, they apply from the next turn."""
        return self._config.generate_params

    @generate_params.setter
    def generate_params(self, value: GenerateParams) -> None:
        if not isinstance(value, GenerateParams):
            raise InvalidParamsError(f"generate_params must be a GenerateParams, got {type(value).__name__}.")
        self._config = replace(self._config, generate_params=value)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """Tool JSON schemas passed to the chat template every turn (set functions or schema dicts)."""
        return None if self._config.tools is None else [dict(t.schema) for t in self._config.tools]

    @tools.setter
    def tools(self, value: Sequence[Any] | None) -> None:
        tools = as_tools(value, self._config.tool_options.timeout)
        if self._config.tool_options.strict and tools is not None:
            strict_grammar(self._template.tokenizer, tools)  # raises before anything changes
        with self._gate.idle("change the tools"):
            self._config = replace(self._config, tools=None if tools is None else tuple(tools))

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """The calls of the last reply that no tool message answers yet (answer them with
        ``respond(result, role=Role.TOOL, tool_call_id=call.id)`` in manual mode)."""
        return pending_calls(self._conversation.messages)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The draft model setup, when decoding is speculative."""
        return self._config.speculative

    @property
    def engine(self) -> BatchEngine | None:
        """The ``BatchEngine`` this session's turns are decoded by, if any."""
        return self._config.engine

    @property
    def last_stats(self) -> TurnStats | None:
        """``TurnStats`` of the last committed turn."""
        return self._last_stats

    @property
    def context_policy(self) -> ContextPolicy:
        """What a turn does when the conversation outgrows the window (``ContextPolicy``); applies from the
        next turn. The history always keeps every message."""
        return self._config.context_policy

    @context_policy.setter
    def context_policy(self, policy: ContextPolicy) -> None:
        if not isinstance(policy, ContextPolicy):
            raise InvalidParamsError(f"context_policy takes a chatkit.ContextPolicy, got {type(policy).__name__}.")
        ropes = self._shift_ropes(policy.checked(), self._conversation.cache.options)
        self._config, self._ropes = replace(self._config, context_policy=policy.checked()), ropes

    @property
    def context(self) -> list[ChatMessage]:
        """What the model sees now: the system prompt (the instructions, then the summary of what a policy
        dropped) and the kept messages. A fresh session built from it answers as this one does."""
        window = self._conversation.window
        system = system_text(self._config.instructions, window.summary)
        return [*([ChatMessage.system(system)] if system is not None else []), *window.visible(self.history)]

    @property
    def dropped_messages(self) -> list[ChatMessage]:
        """The messages a context policy took out of what the model sees (``history`` still has them)."""
        return self._conversation.window.dropped(self.history)

    @property
    def context_window(self) -> int | None:
        """The window prompts must fit, in tokens: the model's, or ``max_kv_size`` or the tokens
        ``max_kv_bytes`` holds when smaller."""
        return window_size(self._context_length, self.cache_options.max_kv_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more token takes in this session's KV cache (counting ``kv_bits``)."""
        options = self.cache_options
        return self._lm.kv_bytes_per_token(options.kv_bits, options.kv_group_size)

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache this session shares KV blocks through (by default its model's process-wide
        one: ``session.prompt_cache.usage()``), ``None`` when off. Set with ``builder.prompt_cache``."""
        cache = self._config.prompt_cache
        return cache if isinstance(cache, PromptCache) else None

    @property
    def token_count(self) -> int:
        """Tokens of the context as the model sees it now (what the cache holds after a turn)."""
        return self._conversation.cache.ledger.opaque + len(self._rendered_ids(self._conversation.window, self.history))

    def count_tokens(self, prompt: str | MessageLike | Sequence[MessageLike], *, params: GenerateParams | None = None) -> int:
        """How many tokens ``prompt`` (a message, or a list of messages of any role: a history) would add
        to the next prompt: ``token_count + count_tokens(m)`` is the next turn's prompt if it does not
        compact. ``params``: a turn's own settings (their template switches, e.g. ``thinking``, shape the
        prompt); by default the session's. Nothing runs on the model."""
        params = checked_params(params, self._config.generate_params, vocab_limit(self._lm, self._config.speculative))
        history, window = self._conversation.messages, self._conversation.window
        messages = prompt_messages(prompt, history, reads_images=self._lm.vision is not None, method="count_tokens")
        before = self._rendered_ids(window, history, params)
        return len(self._rendered_ids(window, [*history, *messages], params, add_generation_prompt=True)) - len(before)

    def check_fits(self, prompt: str | MessageLike | Sequence[MessageLike], *, params: GenerateParams | None = None) -> None:
        """Raise the ``ContextWindowExceededError`` that a turn sending ``prompt`` now would raise, before any
        work: no prefill, no summary written, nothing changes; returns ``None`` when it fits. ``prompt`` is
        what ``respond`` takes, or a list of messages (the earlier ones join the history first, e.g. the
        other tool results of a reply; the last one is answered). ``params``: that turn's own settings (by
        default the session's). Under a policy that compacts, what must fit is the instructions, the summary
        so far and the exchange being answered."""
        params = checked_params(params, self._config.generate_params, vocab_limit(self._lm, self._config.speculative))
        history = self._conversation.messages
        messages = prompt_messages(prompt, history, reads_images=self._lm.vision is not None, method="check_fits")
        if not messages:
            raise InvalidMessageError("check_fits() takes a prompt or a non-empty list of messages.")
        fitted(self._fitter(params, summaries=False), self._conversation, [*history, *messages[:-1]], messages[-1],
               params, self._context_length)

    def prepare_compaction(self) -> bool:
        """Prepare the next compaction now, between turns (e.g. while the user types): once the context is
        past the policy's ``high_water`` mark, choose what the next compaction drops, write its summary
        and prefill the compacted context into a spare cache, so that the turn that crosses the window
        prefills only its message. Returns whether it prepared one. Async turns do this by themselves
        after they end. A turn that comes meanwhile waits for it or compacts without a new summary (the
        policy's ``fallback``); a change to the conversation makes the preparation stale (unused).
        ``SessionBusyError`` while a turn is open."""
        return self._compactor.prepare()

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
        check_cache_options(self._config.speculative, options)
        with self._gate.idle("change the cache options"):
            if options != self.cache_options:
                self._conversation = self._conversation.with_cache(self._new_cache(options))
            self._config = replace(self._config, cache_options=options)

    # -- the adapter ----------------------------------------------------------------------------
    @property
    def adapter(self) -> Adapter | None:
        """The LoRA/DoRA adapter applied to this session's turns (``None``: the base model). Assigning
        one sets it at scale 1 (:meth:`set_adapter` for another scale) and, when it changes, drops the KV
        cache now: the next turn prefills the conversation again."""
        return None if self._config.adapter is None else self._config.adapter.adapter

    @adapter.setter
    def adapter(self, adapter: Adapter | None) -> None:
        self.set_adapter(adapter)

    @property
    def adapter_scale(self) -> float | None:
        """The scale the adapter is applied at (times its own), ``None`` without an adapter."""
        return None if self._config.adapter is None else self._config.adapter.scale

    def set_adapter(self, adapter: Adapter | None, scale: float = 1.0) -> None:
        """Apply ``adapter`` at ``scale`` from the next turn on (``None``: the base model); the KV cache
        was made by the model as it was, so a change starts a new one. ``ModelLoadError`` if it does
        not fit the model; nothing changes then."""
        active = activate(self._lm, adapter, scale)
        with self._gate.idle("change the adapter"):
            if (None if active is None else active.key) != (None if self._config.adapter is None else self._config.adapter.key):
                tool_format = self._tool_format_for(active)  # the adapter's tool-call format: raises before changes
                self._compactor.preparer.wait()  # a compaction being prepared with the old adapter: let it end, then drop it
                self._compactor.preparer.discard()
                self._config = replace(self._config, adapter=active)
                if tool_format is not None:
                    self._template, self._strict = tool_format
                self._conversation = self._conversation.with_cache(self._new_cache(self.cache_options))

    def cache_info(self) -> CacheInfo:
        """What the KV cache holds now."""
        return self._conversation.cache.info()

    def release_cache(self) -> None:
        """Free the KV cache's memory (a prepared compaction's too); the next turn prefills the whole
        conversation again."""
        with self._gate.idle("release the cache"):
            self._conversation.cache.reset()
            self._compactor.preparer.discard()

    def save_cache(self, path: str | os.PathLike[str], *, images: bool = False) -> int:
        """Save the KV cache with the conversation to ``path`` (a ``.safetensors`` file), atomically.

        Restore it with ``ChatSession.builder(lm).cache(path).build()``, or into this session with
        :meth:`restore_cache`. Returns the file's size in bytes. ``NoCacheAvailableError`` before the
        first turn (or after ``clear``/``release_cache``). Over a sharded model every rank writes its
        own shard (rank r > 0 next to ``path``: ``chat.rank1.safetensors``) and fails if any rank fails.
        Images are saved by their content hash and where their tokens are; ``images=True`` keeps their
        pixels too (PNG), so a restored session can prefill them again (else it raises ``CacheError`` when a
        turn needs to).
        """
        with self._gate.idle("save the cache"):
            cache = self._conversation.cache
            if cache.empty or cache.layers is None:
                raise NoCacheAvailableError("There is no KV cache to save yet: run a turn first.")
            c = self._conversation
            conversation = saved.SavedConversation.of_session(self._config, c.messages, c.window, c.earlier)
            return saved.save(path, self._lm, cache.layers, cache.ledger, cache.checkpoints, conversation, cache.options,
                              self._config.adapter, images=images)

    def restore_cache(self, path: str | os.PathLike[str]) -> None:
        """Put back the KV cache of a file this session's conversation was saved to (e.g. by a pool
        that evicted it), checked against the model's fingerprint. The conversation itself stays as
        it is: turns reuse as much of the restored cache as matches it."""
        with self._gate.idle("restore the cache"):
            loaded = saved.load(self._lm, path, raw=False, adapter=self._config.adapter)
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

        It samples with the session's own settings (``config.generate_params``): a turn's own ``params=`` /
        ``logits_processors=`` are not remembered. To answer again with them, ``undo()`` then
        ``respond(prompt, params=...)``.
        """
        return drain(self.stream_regenerate())

    def stream_regenerate(self) -> ReplyStream:
        """As :meth:`regenerate`, streamed. The old reply is replaced when the new one commits."""
        strict = self._config.tool_options.strict and self._config.tools is not None
        if self._runs_tools() and self._conversation.ends_with_tool_round():
            return self._open_turn(None, strict=strict)  # the history's last message, a tool result, is answered
        history = self._conversation.messages
        if self._guided is not None and len(history) >= 2 and self._guided[0] == history[-2]:
            from ..guided.guide import guide  # the guided extra

            prompt, spec = self._guided  # the message as sent (its description appended already)

            def render(message: ChatMessage) -> str:
                return self._text([*history[:-2], message])

            _, constraint = guide(prompt, self._template.tokenizer, render, **spec, include_schema=False, params=self._config.generate_params)
            return GuidedStream(self._open_turn(None, regenerate=True, constraint=constraint), constraint)
        return self._open_turn(None, regenerate=True, strict=strict)

    def fork(self, *, history: Iterable[MessageLike] | None = None) -> ChatSession:
        """An independent session with the same conversation, settings and a copy of the cache.

        The copy shares the cached prefix's memory until one of the two writes, so both branches go on
        without prefilling the past again. ``history``: the branch's messages instead (without the
        instructions; e.g. this conversation up to a point, then otherwise): it keeps the cache copy, and
        its first turn reuses the prefix the two renderings share (the rest is trimmed then).
        """
        messages = None if history is None else as_messages(history)
        if messages and messages[0].role is Role.SYSTEM:
            raise InvalidMessageError("fork(history=...) takes the messages after the instructions: drop the system message.")
        with self._gate.idle("fork"):
            other = ChatSession(self._lm, replace(self._config, generate_params=self._config.generate_params.copy()))
            copied = self._conversation.copy()
            other._conversation = copied if messages is None else Conversation(messages, copied.cache)
            other._images = self._images.copy() if self._images is not None else None  # encoded images too
            other._template.continue_from(self._template)  # the prompt tokenized so far, too
            other._last_stats = self._last_stats
            other._guided = self._guided if messages is None else None
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
        this prompt. ``params=GenerateParams(...)`` samples this turn (every round of its tool loop) with
        its own settings, ``logits_processors=[...]`` adds processors after them; the session's own
        (``config``) stay as they were for the next turn. Every option is checked before anything changes
        (:class:`TurnOptions`).
        """
        checked = TurnOptions.of(options)
        message = checked.message(prompt, self._conversation.messages, reads_images=self._lm.vision is not None)
        if checked.strict_tools and self._config.tools is None:
            raise InvalidParamsError("strict_tools=True but the session has no tools: set them with builder.tools([...]).")
        if checked.guided:
            return self._guided_turn(message, checked)
        params = checked.turn_params(self._config.generate_params, vocab_limit(self._lm, self._config.speculative))
        strict = self._config.tool_options.strict if checked.strict_tools is None else checked.strict_tools
        plain = self._open_turn(message, params=params) if self._config.tools is None and message.role is not Role.TOOL else None
        opened = plain if plain is not None else self._tool_loop(message, strict=strict, params=params)
        self._guided = None  # the last reply is not guided: regenerate() answers it freely, even to the same text
        return opened

    def astream_respond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> AsyncResponseStream:
        """As :meth:`stream_respond`, for ``async for``: generation runs on a worker thread, which then
        prepares the next compaction when the context policy has one to prepare."""
        stop = threading.Event()  # stream_respond may still wait on the previous async turn's
        inner = self.stream_respond(prompt, **options)
        kind = AsyncGuidedStream if isinstance(inner, GuidedStream) else AsyncResponseStream
        after = self._compactor.claim if self._config.context_policy.mode != "error" else None
        stream = kind(inner, stop=stop, after=after)  # type: ignore[arg-type]
        self._gate.async_stop = stop
        return stream

    async def arespond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> Any:
        """As :meth:`respond`, without blocking the event loop. Cancelling it commits the reply so far."""
        async with self.astream_respond(prompt, **options) as stream:
            async for _ in stream:
                pass
        return stream.result()

    def render(self, prompt: str | MessageLike | None = None, *, role: Role | str = Role.USER) -> str:
        """The prompt text the model would see if ``prompt`` were sent now (the template's output, through the
        context window as it is now: a turn that must compact shows the model less)."""
        history = self._conversation.messages
        if prompt is None:
            return self._text(history, add_generation_prompt=False)
        return self._text([*history, TurnOptions(role=role).message(prompt, history)])


__all__ = ["ChatSession"]
