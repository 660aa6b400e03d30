"""``ChatSession``: a conversation with a model that reuses its KV cache from turn to turn.

A turn is a pipeline: render (template) -> plan and prefill (cache) -> stream (generation, stream)
-> commit. The session is composed of its state (``SessionState``: settings, history, cache), the
``TurnFactory`` over it that opens and settles turns (``turns.py``) and the ``Compactor`` the factory
makes; its methods check their input and delegate. Every turn method is one entry
(:meth:`ChatSession.stream_respond`: the options checked once, then the turn opened), of which the
others are short wrappers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from typing_extensions import Self, Unpack

from ..cache.prompt import PromptCache
from ..cache.state import CacheInfo, CacheOptions, CacheState
from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig, check_cache_options, vocab_limit
from ..errors import InvalidMessageError, InvalidParamsError, NoCacheAvailableError
from ..messages import ChatMessage, MessageLike, Role, ToolCall, check_instructions
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..model.switchable import activate
from ..params import GenerateParams
from ..tools import as_tools
from . import saved
from .aio import AsyncGuidedStream, AsyncResponseStream
from .builder import ChatSessionBuilder
from .config import SessionConfig
from .context import ContextPolicy, Window, system_text, window_size
from .conversation import pending_calls
from .options import TurnKeywords, TurnOptions, branch_history, checked_params, prompt_messages
from .results import TurnStats
from .streams import GuidedStream, ReplyStream, drain
from .tool_loop import strict_grammar
from .turn import fitted
from .turns import TurnFactory, new_state


class ChatSession:
    """A stateful conversation with one model. Build it with :meth:`ChatSession.builder`.

    One turn at a time: while a stream is open (with tools, until the loop's answer), starting another
    turn, ``clear()`` or editing the conversation raises ``SessionBusyError`` and changes nothing.
    """

    def __init__(self, lm: LoadedModel, config: SessionConfig | None = None, *, history: Sequence[ChatMessage] = (),
                 **settings: Any) -> None:
        """Prefer :meth:`builder`, which also restores saved caches. ``config`` (default: the defaults) with
        ``settings`` (``SessionConfig`` field names, e.g. ``instructions=``) over it; all checked here."""
        if not isinstance(lm, LoadedModel):
            raise InvalidParamsError(f"A session needs a chatkit.load(...) result, got {type(lm).__name__}.")
        self._state = new_state(lm, SessionConfig.of(config, settings).checked(lm), history)  # what the session holds
        self._turns = TurnFactory(self._state, type(self))  # the turn pipeline over it
        self._compactor = self._turns.compactor  # compactions prepared between turns

    @classmethod
    def _start(cls, lm: LoadedModel, config: SessionConfig, history: Sequence[ChatMessage] = (),
               cache: CacheState | None = None, window: Window = Window(), earlier: tuple[tuple[int, Window], ...] = ()) -> Self:
        """The session a builder describes: ``config`` over ``history`` (seen through ``window``, a restored
        context policy's), going on from ``cache`` when one is restored."""
        session = cls(lm, config, history=history)
        session._turns.resume(cache, window, earlier)
        return session

    @staticmethod
    def builder(model: LoadedModel | Any, tokenizer: Any = None) -> ChatSessionBuilder[ChatSession]:
        """Start building a session over a loaded model (``chatkit.load``) or a model and tokenizer."""
        return ChatSessionBuilder(model, tokenizer, factory=ChatSession._start)

    # -- conversation state -------------------------------------------------------------------
    @property
    def model(self) -> LoadedModel:
        return self._state.lm

    @property
    def config(self) -> SessionConfig:
        """This session's settings, one frozen ``SessionConfig`` (its ``generate_params`` a copy: mutating it
        changes nothing). The setters below (``instructions``, ``generate_params``, ...) replace it; a turn's
        own ``params=`` never change it. ``ChatSession(lm, dataclasses.replace(session.config, ...))`` builds
        a new session with changed settings."""
        return replace(self._state.config, generate_params=self._state.config.generate_params.copy())

    @property
    def history(self) -> list[ChatMessage]:
        """The conversation so far (without the instructions), as a copy."""
        return list(self._state.conversation.messages)

    @property
    def instructions(self) -> str | None:
        """The system prompt, rendered at the start of every turn's prompt; ``None`` for none."""
        return self._state.config.instructions

    @instructions.setter
    def instructions(self, value: str | None) -> None:
        with self._state.gate.idle("change the instructions"):
            self._state.config = replace(self._state.config, instructions=check_instructions(value))

    @property
    def generate_params(self) -> GenerateParams:
        """The sampling settings; mutate them or assign new ones, they apply from the next turn."""
        return self._state.config.generate_params

    @generate_params.setter
    def generate_params(self, value: GenerateParams) -> None:
        if not isinstance(value, GenerateParams):
            raise InvalidParamsError(f"generate_params must be a GenerateParams, got {type(value).__name__}.")
        self._state.config = replace(self._state.config, generate_params=value)

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        """Tool JSON schemas passed to the chat template every turn (set functions or schema dicts)."""
        return None if self._state.config.tools is None else [dict(t.schema) for t in self._state.config.tools]

    @tools.setter
    def tools(self, value: Sequence[Any] | None) -> None:
        tools = as_tools(value, self._state.config.tool_options.timeout)
        if self._state.config.tool_options.strict and tools is not None:
            strict_grammar(self._state.template.tokenizer, tools)  # raises before anything changes
        with self._state.gate.idle("change the tools"):
            self._state.config = replace(self._state.config, tools=None if tools is None else tuple(tools))

    @property
    def pending_tool_calls(self) -> list[ToolCall]:
        """The calls of the last reply that no tool message answers yet (answer them with
        ``respond(result, role=Role.TOOL, tool_call_id=call.id)`` in manual mode)."""
        return pending_calls(self._state.conversation.messages)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The draft model setup, when decoding is speculative."""
        return self._state.config.speculative

    @property
    def engine(self) -> BatchEngine | None:
        """The ``BatchEngine`` this session's turns are decoded by, if any."""
        return self._state.config.engine

    @property
    def last_stats(self) -> TurnStats | None:
        """``TurnStats`` of the last committed turn."""
        return self._state.last_stats

    @property
    def context_policy(self) -> ContextPolicy:
        """What a turn does when the conversation outgrows the window (``ContextPolicy``); applies from the
        next turn. The history always keeps every message."""
        return self._state.config.context_policy

    @context_policy.setter
    def context_policy(self, policy: ContextPolicy) -> None:
        if not isinstance(policy, ContextPolicy):
            raise InvalidParamsError(f"context_policy takes a chatkit.ContextPolicy, got {type(policy).__name__}.")
        ropes = self._turns.shift_ropes(policy.checked(), self._state.conversation.cache.options)
        self._state.config, self._state.ropes = replace(self._state.config, context_policy=policy.checked()), ropes

    @property
    def context(self) -> list[ChatMessage]:
        """What the model sees now: the system prompt (the instructions, then the summary of what a policy
        dropped) and the kept messages. A fresh session built from it answers as this one does."""
        window = self._state.conversation.window
        system = system_text(self._state.config.instructions, window.summary)
        return [*([ChatMessage.system(system)] if system is not None else []), *window.visible(self.history)]

    @property
    def dropped_messages(self) -> list[ChatMessage]:
        """The messages a context policy took out of what the model sees (``history`` still has them)."""
        return self._state.conversation.window.dropped(self.history)

    @property
    def context_window(self) -> int | None:
        """The window prompts must fit, in tokens: the model's, or ``max_kv_size`` or the tokens
        ``max_kv_bytes`` holds when smaller."""
        return window_size(self._turns.context_length, self.cache_options.max_kv_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one more token takes in this session's KV cache (counting ``kv_bits``)."""
        options = self.cache_options
        return self._state.lm.kv_bytes_per_token(options.kv_bits, options.kv_group_size)

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The prompt cache this session shares KV blocks through (by default its model's process-wide
        one: ``session.prompt_cache.usage()``), ``None`` when off. Set with ``builder.prompt_cache``."""
        cache = self._state.config.prompt_cache
        return cache if isinstance(cache, PromptCache) else None

    @property
    def token_count(self) -> int:
        """Tokens of the context as the model sees it now (what the cache holds after a turn)."""
        c = self._state.conversation
        return c.cache.ledger.opaque + len(self._turns.rendered_ids(c.window, c.messages))

    def count_tokens(self, prompt: str | MessageLike | Sequence[MessageLike], *, params: GenerateParams | None = None) -> int:
        """How many tokens ``prompt`` (a message, or a list of messages of any role: a history) would add
        to the next prompt: ``token_count + count_tokens(m)`` is the next turn's prompt if it does not
        compact. ``params``: a turn's own settings (their template switches, e.g. ``thinking``, shape the
        prompt); by default the session's. Nothing runs on the model."""
        s = self._state
        params = checked_params(params, s.config.generate_params, vocab_limit(s.lm, s.config.speculative))
        history, window = s.conversation.messages, s.conversation.window
        messages = prompt_messages(prompt, history, reads_images=s.lm.vision is not None, method="count_tokens")
        before = self._turns.rendered_ids(window, history, params)
        return len(self._turns.rendered_ids(window, [*history, *messages], params, add_generation_prompt=True)) - len(before)

    def check_fits(self, prompt: str | MessageLike | Sequence[MessageLike], *, params: GenerateParams | None = None) -> None:
        """Raise the ``ContextWindowExceededError`` that a turn sending ``prompt`` now would raise, before any
        work: no prefill, no summary written, nothing changes; returns ``None`` when it fits. ``prompt`` is
        what ``respond`` takes, or a list of messages (the earlier ones join the history first, e.g. the
        other tool results of a reply; the last one is answered). ``params``: that turn's own settings (by
        default the session's). Under a policy that compacts, what must fit is the instructions, the summary
        so far and the exchange being answered."""
        s = self._state
        params = checked_params(params, s.config.generate_params, vocab_limit(s.lm, s.config.speculative))
        history = s.conversation.messages
        messages = prompt_messages(prompt, history, reads_images=s.lm.vision is not None, method="check_fits")
        if not messages:
            raise InvalidMessageError("check_fits() takes a prompt or a non-empty list of messages.")
        fitted(self._turns.fitter(params, summaries=False), s.conversation, [*history, *messages[:-1]], messages[-1],
               params, self._turns.context_length)

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
        return self._state.gate.busy

    def clear(self) -> None:
        """Forget the history and the cache (the instructions stay)."""
        with self._state.gate.idle("clear the session"):
            self._state.conversation.clear()

    # -- the cache ----------------------------------------------------------------------------
    @property
    def cache_options(self) -> CacheOptions:
        """How the KV cache is built; assigning new options rebuilds the cache at the next turn."""
        return self._state.conversation.cache.options

    @cache_options.setter
    def cache_options(self, options: CacheOptions) -> None:
        if not isinstance(options, CacheOptions):
            raise InvalidParamsError(f"cache_options must be a CacheOptions, got {type(options).__name__}.")
        s = self._state
        options.validate(s.lm.head_dim)
        check_cache_options(s.config.speculative, options)
        with s.gate.idle("change the cache options"):
            if options != self.cache_options:
                s.conversation = s.conversation.with_cache(self._turns.new_cache(options))
            s.config = replace(s.config, cache_options=options)

    # -- the adapter ----------------------------------------------------------------------------
    @property
    def adapter(self) -> Adapter | None:
        """The LoRA/DoRA adapter applied to this session's turns (``None``: the base model). Assigning
        one sets it at scale 1 (:meth:`set_adapter` for another scale) and, when it changes, drops the KV
        cache now: the next turn prefills the conversation again."""
        return None if self._state.config.adapter is None else self._state.config.adapter.adapter

    @adapter.setter
    def adapter(self, adapter: Adapter | None) -> None:
        self.set_adapter(adapter)

    @property
    def adapter_scale(self) -> float | None:
        """The scale the adapter is applied at (times its own), ``None`` without an adapter."""
        return None if self._state.config.adapter is None else self._state.config.adapter.scale

    def set_adapter(self, adapter: Adapter | None, scale: float = 1.0) -> None:
        """Apply ``adapter`` at ``scale`` from the next turn on (``None``: the base model); the KV cache
        was made by the model as it was, so a change starts a new one. ``ModelLoadError`` if it does
        not fit the model; nothing changes then."""
        active = activate(self._state.lm, adapter, scale)
        with self._state.gate.idle("change the adapter"):
            self._turns.use_adapter(active)

    def cache_info(self) -> CacheInfo:
        """What the KV cache holds now."""
        return self._state.conversation.cache.info()

    def release_cache(self) -> None:
        """Free the KV cache's memory (a prepared compaction's too); the next turn prefills the whole
        conversation again."""
        with self._state.gate.idle("release the cache"):
            self._state.conversation.cache.reset()
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
        s = self._state
        with s.gate.idle("save the cache"):
            cache = s.conversation.cache
            if cache.empty or cache.layers is None:
                raise NoCacheAvailableError("There is no KV cache to save yet: run a turn first.")
            c = s.conversation
            conversation = saved.SavedConversation.of_session(s.config, c.messages, c.window, c.earlier)
            return saved.save(path, s.lm, cache.layers, cache.ledger, cache.checkpoints, conversation, cache.options,
                              s.config.adapter, images=images)

    def restore_cache(self, path: str | os.PathLike[str]) -> None:
        """Put back the KV cache of a file this session's conversation was saved to (e.g. by a pool
        that evicted it), checked against the model's fingerprint. The conversation itself stays as
        it is: turns reuse as much of the restored cache as matches it."""
        s = self._state
        with s.gate.idle("restore the cache"):
            loaded = saved.load(s.lm, path, raw=False, adapter=s.config.adapter)
            # A draft's cache is not saved: it is refilled from the ledger at the next turn.
            self._turns.use_cache(CacheState.restored(
                s.lm.model, self.cache_options, loaded.layers, loaded.ledger, loaded.checkpoints, self._turns.draft_model
            ))

    # -- editing --------------------------------------------------------------------------------
    def undo(self) -> list[ChatMessage]:
        """Drop the last exchange (the prompt and its reply; with automatic tools, the tool calls and
        results in between too, also of a tool loop that stopped before its answer), rewind the cache
        to match, and return it."""
        with self._state.gate.idle("undo"):
            return self._state.conversation.undo(self._turns.runs_tools(), self._turns.rendered_ids)

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
        return self._turns.regenerate()

    def fork(self, *, history: Iterable[MessageLike] | None = None) -> ChatSession:
        """An independent session with the same conversation, settings and a copy of the cache.

        The copy shares the cached prefix's memory until one of the two writes, so both branches go on
        without prefilling the past again. ``history``: the branch's messages instead (after this session's
        instructions; seen whole: no context policy's window or summary carried over). It keeps the cache
        copy, whose common prefix with the new rendering its first turn reuses (a cache a context shift
        rotated is dropped). ``InvalidMessageError`` for a leading system message or an unreadable image.
        """
        messages = None if history is None else branch_history(history, reads_images=self._state.lm.vision is not None)
        s = self._state
        with s.gate.idle("fork"):
            other = type(self)(s.lm, replace(s.config, generate_params=s.config.generate_params.copy()))
            self._turns.fork_into(other._state, messages)
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
        s, turns = self._state, self._turns
        checked = TurnOptions.of(options)
        message = checked.message(prompt, s.conversation.messages, reads_images=s.lm.vision is not None)
        if checked.strict_tools and s.config.tools is None:
            raise InvalidParamsError("strict_tools=True but the session has no tools: set them with builder.tools([...]).")
        if checked.guided:
            return turns.guided_turn(message, checked)
        c = s.config
        params = checked.turn_params(c.generate_params, vocab_limit(s.lm, c.speculative))
        strict = c.tool_options.strict if checked.strict_tools is None else checked.strict_tools
        plain = turns.open_turn(message, params=params) if c.tools is None and message.role is not Role.TOOL else None
        opened = plain if plain is not None else turns.tool_loop(message, strict=strict, params=params)
        s.guided = None  # the last reply is not guided: regenerate() answers it freely, even to the same text
        return opened

    def astream_respond(self, prompt: str | MessageLike, **options: Unpack[TurnKeywords]) -> AsyncResponseStream:
        """As :meth:`stream_respond`, for ``async for``: generation runs on a worker thread, which then
        prepares the next compaction when the context policy has one to prepare."""
        stop = threading.Event()  # stream_respond may still wait on the previous async turn's
        inner = self.stream_respond(prompt, **options)
        kind = AsyncGuidedStream if isinstance(inner, GuidedStream) else AsyncResponseStream
        after = self._compactor.claim if self._state.config.context_policy.mode != "error" else None
        stream = kind(inner, stop=stop, after=after)  # type: ignore[arg-type]
        self._state.gate.async_stop = stop
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
        history = self._state.conversation.messages
        if prompt is None:
            return self._turns.text(history, add_generation_prompt=False)
        return self._turns.text([*history, TurnOptions(role=role).message(prompt, history)])


__all__ = ["ChatSession"]
