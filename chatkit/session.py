"""``ChatSession``: a conversation with a model that reuses its KV cache from turn to turn.

A turn is a pipeline: render (template) -> plan and prefill (cache) -> stream (generation, stream)
-> commit (here). The session owns the history and the cache state and sequences the steps.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import mlx.core as mx

from .aio import AsyncResponseStream
from .cache import store
from .cache.state import CacheInfo, CacheOptions, CacheState
from .errors import (
    ChatKitError,
    ContextWindowExceededError,
    InvalidMessageError,
    InvalidParamsError,
    NoCacheAvailableError,
    NothingToUndoError,
    SessionBusyError,
)
from .generation import generate_tokens, with_context
from .loading import LoadedModel
from .messages import ChatMessage, MessageLike, Role, as_message, check_text
from .params import GenerateParams
from .speculative import SpeculativeConfig
from .stream import ResponseStream, TurnResult, TurnStats
from .template import ChatTemplate

if TYPE_CHECKING:
    from .builder import ChatSessionBuilder

ProgressCallback = Callable[[int, int], None]
STOPPING_TURN_WAIT = 60.0  # seconds; a stopping async turn may still be finishing a prefill chunk


class ChatSession:
    """A stateful conversation with one model. Build it with :meth:`ChatSession.builder`.

    One turn at a time: while a stream is open, starting another turn, ``clear()`` or editing the
    conversation raises ``SessionBusyError`` and changes nothing.
    """

    def __init__(
        self,
        lm: LoadedModel,
        *,
        instructions: str | None = None,
        history: Sequence[ChatMessage] = (),
        generate_params: GenerateParams | None = None,
        chat_template: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        cache_options: CacheOptions = CacheOptions(),
        prefill_progress: ProgressCallback | None = None,
        cache: CacheState | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self._lm = lm
        self._template = ChatTemplate(lm.tokenizer, chat_template)
        self._instructions = _check_instructions(instructions)
        self._history = list(history)
        self._params = generate_params if generate_params is not None else GenerateParams()
        self._tools = _check_tools(tools)
        cache_options.validate()
        _check_kv_group_size(lm, cache_options)
        self._speculative = speculative
        _check_speculative_options(speculative, cache_options)
        draft_model = speculative.draft.model if speculative is not None else None
        self._cache = cache if cache is not None else CacheState(lm.model, cache_options, draft_model)
        self._progress = prefill_progress
        self._turn = threading.Lock()  # held from the start of a turn until it commits or aborts
        self._async_stop: threading.Event | None = None  # set once the last async turn was told to stop
        self._last_stats: TurnStats | None = None

    @staticmethod
    def builder(model: LoadedModel | Any, tokenizer: Any = None) -> "ChatSessionBuilder":
        """Start building a session over a loaded model (``chatkit.load``) or a model and tokenizer."""
        from .builder import ChatSessionBuilder

        return ChatSessionBuilder(model, tokenizer)

    # -- conversation state -------------------------------------------------------------------
    @property
    def model(self) -> LoadedModel:
        return self._lm

    @property
    def history(self) -> list[ChatMessage]:
        """The conversation so far (without the instructions), as a copy."""
        return list(self._history)

    @property
    def instructions(self) -> str | None:
        """The system prompt, rendered at the start of every turn's prompt; ``None`` for none."""
        return self._instructions

    @instructions.setter
    def instructions(self, value: str | None) -> None:
        with self._idle("change the instructions"):
            self._instructions = _check_instructions(value)

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
        """Tool JSON schemas passed to the chat template every turn."""
        return None if self._tools is None else [dict(t) for t in self._tools]

    @tools.setter
    def tools(self, value: Sequence[Mapping[str, Any]] | None) -> None:
        with self._idle("change the tools"):
            self._tools = _check_tools(value)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The draft model setup, when decoding is speculative."""
        return self._speculative

    @property
    def last_stats(self) -> TurnStats | None:
        """``TurnStats`` of the last committed turn."""
        return self._last_stats

    @property
    def busy(self) -> bool:
        """Whether a turn is in progress (a stream is open)."""
        return self._turn.locked()

    def clear(self) -> None:
        """Forget the history and the cache (the instructions stay)."""
        with self._idle("clear the session"):
            self._history = []
            self._cache.reset()

    @property
    def cache_options(self) -> CacheOptions:
        """How the KV cache is built; assigning new options rebuilds the cache at the next turn."""
        return self._cache.options

    @cache_options.setter
    def cache_options(self, options: CacheOptions) -> None:
        if not isinstance(options, CacheOptions):
            raise InvalidParamsError(f"cache_options must be a CacheOptions, got {type(options).__name__}.")
        options.validate()
        _check_kv_group_size(self._lm, options)
        _check_speculative_options(self._speculative, options)
        with self._idle("change the cache options"):
            if options != self._cache.options:
                draft_model = self._speculative.draft.model if self._speculative is not None else None
                self._cache = CacheState(self._lm.model, options, draft_model)

    def cache_info(self) -> CacheInfo:
        """What the KV cache holds now."""
        return self._cache.info()

    def release_cache(self) -> None:
        """Free the KV cache's memory; the next turn prefills the whole conversation again."""
        with self._idle("release the cache"):
            self._cache.reset()

    def save_cache(self, path: str | os.PathLike[str]) -> int:
        """Save the KV cache with the conversation to ``path`` (a ``.safetensors`` file), atomically.

        Restore it with ``ChatSession.builder(lm).cache(path).build()``. Returns the file's size in
        bytes. ``NoCacheAvailableError`` before the first turn (or after ``clear``/``release_cache``).
        """
        with self._idle("save the cache"):
            cache = self._cache
            if cache.empty:
                raise NoCacheAvailableError("There is no KV cache to save yet: run a turn first.")
            return store.save(
                path,
                cache.layers,
                cache.ledger,
                fingerprint=self._lm.fingerprint,
                instructions=self._instructions,
                messages=[m.to_dict() for m in self._history],
                generate_params=self._params.to_dict(),
                cache_options=asdict(cache.options),
                checkpoints=cache.checkpoints,
            )

    def _restore_cache_file(self, path: str | os.PathLike[str]) -> None:
        """Put back a cache this session saved (for a pool that evicted it); checked like a restore."""
        with self._idle("restore the cache"):
            saved = store.load(path)
            store.check_fingerprint(self._lm.fingerprint, saved.info.fingerprint, repr(str(path)))
            store.check_layers(self._lm.model, saved, repr(str(path)))
            # A draft's cache is not saved: it is refilled from the ledger at the next turn.
            draft_model = self._speculative.draft.model if self._speculative is not None else None
            self._cache = CacheState.restored(
                self._lm.model, self._cache.options, saved.layers, saved.ledger, saved.checkpoints, draft_model
            )

    # -- editing --------------------------------------------------------------------------------
    def undo(self) -> list[ChatMessage]:
        """Drop the last exchange (the prompt and its reply), rewind the cache to match, and return it."""
        with self._idle("undo"):
            if not _ends_with_exchange(self._history):
                raise NothingToUndoError("There is no exchange to undo: the history does not end with a reply.")
            dropped, self._history = self._history[-2:], self._history[:-2]
            try:
                self._cache.rewind(self._render_history())
            except ChatKitError:
                self._cache.reset()
            return dropped

    def regenerate(self) -> str:
        """Answer the last prompt again, replacing the last reply; returns the new reply."""
        with self.stream_regenerate() as stream:
            for _ in stream:
                pass
        return stream.text

    def stream_regenerate(self) -> ResponseStream:
        """As :meth:`regenerate`, streamed. The old reply is replaced when the new one commits."""
        params = self._params
        params.validate(_vocab_size(self._lm, self._speculative))
        if not self._take_turn():
            raise SessionBusyError("This session already has a turn in progress: finish or close its stream first.")
        try:
            if not _ends_with_exchange(self._history):
                raise NothingToUndoError("There is no reply to regenerate: the history does not end with a reply.")
            return self._start_turn(self._history[:-2], self._history[-2], params.copy())
        except BaseException:
            self._turn.release()
            raise

    def fork(self) -> "ChatSession":
        """An independent session with the same conversation, settings and a copy of the cache.

        The copy shares the cached prefix's memory until one of the two writes, so both branches go on
        without prefilling the past again.
        """
        with self._idle("fork"):
            other = ChatSession(
                self._lm,
                instructions=self._instructions,
                history=self._history,
                generate_params=self._params.copy(),
                chat_template=self._template.template,
                tools=self._tools,
                cache_options=self._cache.options,
                prefill_progress=self._progress,
                speculative=self._speculative,
            )
            other._cache = self._cache.copy()
            other._last_stats = self._last_stats
            return other

    # -- turns --------------------------------------------------------------------------------
    def respond(self, prompt: str | MessageLike, *, role: Role | str = Role.USER) -> str:
        """Send ``prompt`` and return the whole reply."""
        with self.stream_respond(prompt, role=role) as stream:
            for _ in stream:
                pass
        return stream.text

    def stream_respond(self, prompt: str | MessageLike, *, role: Role | str = Role.USER) -> ResponseStream:
        """Send ``prompt`` and return the reply as a :class:`ResponseStream` of text chunks.

        ``prompt`` is the text of a message from ``role`` (user by default; tool results with
        ``Role.TOOL``), or a ``ChatMessage``/dict. Nothing runs until the stream is iterated.
        """
        message = _prompt_message(prompt, role)
        params = self._params
        params.validate(_vocab_size(self._lm, self._speculative))
        if not self._take_turn():
            raise SessionBusyError(
                "This session already has a turn in progress: finish or close its stream first."
            )
        try:
            return self._start_turn(self._history, message, params.copy())
        except BaseException:
            self._turn.release()
            raise

    def astream_respond(self, prompt: str | MessageLike, *, role: Role | str = Role.USER) -> AsyncResponseStream:
        """As :meth:`stream_respond`, for ``async for``: generation runs on a worker thread."""
        stop = threading.Event()  # stream_respond may still wait on the previous async turn's
        stream = AsyncResponseStream(self.stream_respond(prompt, role=role), stop=stop)
        self._async_stop = stop
        return stream

    async def arespond(self, prompt: str | MessageLike, *, role: Role | str = Role.USER) -> str:
        """As :meth:`respond`, without blocking the event loop. Cancelling it commits the reply so far."""
        async with self.astream_respond(prompt, role=role) as stream:
            async for _ in stream:
                pass
        return stream.text

    def render(self, prompt: str | MessageLike | None = None, *, role: Role | str = Role.USER) -> str:
        """The prompt text the model would see if ``prompt`` were sent now (the template's output)."""
        if prompt is None:
            return self._render_text(self._history, self._params, add_generation_prompt=False)
        return self._render_text([*self._history, _prompt_message(prompt, role)], self._params)

    def _start_turn(
        self, base: list[ChatMessage], message: ChatMessage, params: GenerateParams
    ) -> ResponseStream:
        """Prepare a turn that answers ``message`` after ``base``; the turn lock is held."""
        prompt = self._render([*base, message], params)
        context = self._lm.context_length
        needed = self._cache.ledger.opaque + len(prompt)  # a restored raw cache stays in front
        if context is not None and needed >= context:
            raise ContextWindowExceededError(
                f"The prompt is {needed} tokens but the model's context window is {context}: "
                "shorten the conversation (e.g. clear() or start a new session with less history).",
                prompt_tokens=needed,
                context_length=context,
            )
        max_tokens = params.max_tokens if context is None else min(params.max_tokens, context - needed)
        cache = self._cache
        fed: list[int] = []

        def start():
            if params.seed is not None:
                mx.random.seed(params.seed)
            plan = cache.prepare(prompt)
            fed.extend(plan.suffix)
            processors = with_context(params.make_logits_processors(), cache.ledger.tokens)
            user_progress = self._progress

            def progress(done: int, total: int) -> None:
                if done == total - 1:  # the whole prompt but its last token is in: a rewind point
                    cache.checkpoint()
                if user_progress is not None:
                    user_progress(done, total)

            spec = self._speculative
            draft = None if spec is None else (spec.draft.model, cache.draft_layers, spec.num_draft_tokens)
            return len(plan.suffix), generate_tokens(
                self._lm.model,
                cache.layers,
                plan.suffix,
                max_tokens=max_tokens,
                sampler=params.make_sampler(),
                logits_processors=processors,
                options=cache.options,
                progress=progress,
                draft=draft,
            )

        def commit(result: TurnResult) -> None:
            try:
                cache.record([*fed, *result.tokens])
                self._history = [*base, message, ChatMessage.assistant(result.text)]
                self._last_stats = result.stats
            finally:
                self._turn.release()

        def abort(exc: BaseException | None) -> None:
            try:
                if fed:  # the cache was touched: keep what it provably holds, or drop it
                    cache.record(fed)
            finally:
                self._turn.release()

        tokenizer = self._lm.tokenizer
        return ResponseStream(
            start,
            detokenizer=tokenizer.detokenizer,
            eos_token_ids=sorted(tokenizer.eos_token_ids),
            max_tokens=max_tokens,
            stop=params.stop,
            prompt_tokens=needed,
            on_commit=commit,
            on_abort=abort,
            num_draft_tokens=self._speculative.num_draft_tokens if self._speculative is not None else 0,
        )

    def _render_text(
        self, messages: Sequence[ChatMessage], params: GenerateParams, *, add_generation_prompt: bool = True
    ) -> str:
        system = [ChatMessage.system(self._instructions)] if self._instructions is not None else []
        return self._template.render(
            [*system, *messages],
            tools=self._tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=params.template_kwargs,
        )

    def _render(
        self, messages: Sequence[ChatMessage], params: GenerateParams, *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self._render_text(messages, params, add_generation_prompt=add_generation_prompt)
        return self._template.encode(text)

    def _render_history(self) -> list[int]:
        """The ids of the conversation as it stands, without a generation prompt."""
        if not self._history and self._instructions is None:
            return []
        return self._render(self._history, self._params, add_generation_prompt=False)

    def _take_turn(self) -> bool:
        """Take the turn lock. An async turn that was told to stop (cancelled, closed, or its stream
        dropped) commits on its worker within a decode step: wait for that rather than fail."""
        if self._turn.acquire(blocking=False):
            return True
        stop = self._async_stop
        return stop is not None and stop.is_set() and self._turn.acquire(timeout=STOPPING_TURN_WAIT)

    def _idle(self, action: str) -> "_Idle":
        return _Idle(self, action)


class _Idle:
    """Holds the turn lock for a short edit; ``SessionBusyError`` while a stream is open."""

    def __init__(self, session: ChatSession, action: str) -> None:
        self._session, self._action = session, action

    def __enter__(self) -> None:
        if not self._session._take_turn():
            raise SessionBusyError(f"Cannot {self._action} while a reply is streaming: close the stream first.")

    def __exit__(self, *exc_info: object) -> None:
        self._session._turn.release()


def _check_speculative_options(speculative: SpeculativeConfig | None, options: CacheOptions) -> None:
    # mlx-lm's speculative loop rewinds rejected draft tokens by trimming: a full rotating cache keeps
    # them, and kv_bits swaps cache objects inside a list we do not see. Neither can be made exact.
    if speculative is not None and (options.max_kv_size is not None or options.kv_bits is not None):
        raise InvalidParamsError(
            "Speculative decoding cannot be exact with max_kv_size or kv_bits (rejected draft tokens "
            "could not be rewound): drop those options or drop .speculative(...)."
        )


def _check_kv_group_size(lm: LoadedModel, options: CacheOptions) -> None:
    """Quantized KV groups must tile a head: otherwise mlx fails inside the first turn."""
    head_dim = _head_dim(lm)
    if options.kv_bits is not None and head_dim is not None and head_dim % options.kv_group_size:
        fits = [g for g in (128, 64, 32) if head_dim % g == 0]
        raise InvalidParamsError(
            f"kv_group_size={options.kv_group_size} does not divide this model's head size ({head_dim}): "
            + (f"use a group size of {fits[0]} (kv_bits(..., group_size={fits[0]}), or --kv-group-size {fits[0]} "
               "on the command line)." if fits else "this model's KV cache cannot be quantized.")
        )


def _head_dim(lm: LoadedModel) -> int | None:
    """The attention head size: mlx-lm's model args first (they hold defaults a config may omit, e.g.
    Gemma 3's 256), then the config, then hidden size / heads; ``None`` when nothing says."""
    config = getattr(lm, "config", None) or {}
    config = config.get("text_config", config)
    for value in (getattr(getattr(lm.model, "args", None), "head_dim", None), config.get("head_dim")):
        if isinstance(value, int):
            return value
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _ends_with_exchange(history: Sequence[ChatMessage]) -> bool:
    return len(history) >= 2 and history[-1].role is Role.ASSISTANT and history[-2].role is not Role.ASSISTANT


def _prompt_message(prompt: str | MessageLike, role: Role | str) -> ChatMessage:
    if isinstance(prompt, str):
        message = ChatMessage(Role.parse(role), prompt)
    elif isinstance(prompt, (ChatMessage, Mapping)):
        message = as_message(prompt)
    else:
        raise InvalidMessageError(f"A prompt is a str or a message, got {type(prompt).__name__}.")
    if not message.content.strip():
        raise InvalidMessageError("The prompt is empty: send some text.")
    if message.role is Role.ASSISTANT:
        raise InvalidMessageError("A prompt cannot come from the assistant: use role user, tool or system.")
    return message


def _vocab_size(lm: LoadedModel, speculative: SpeculativeConfig | None) -> int:
    """Token ids must be below this in every model a turn runs (mlx-lm biases the draft's logits too)."""
    return lm.vocab_size if speculative is None else min(lm.vocab_size, speculative.draft.vocab_size)


def _check_instructions(value: str | None) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidMessageError(f"Instructions must be a str or None, got {type(value).__name__}.")
    if value is not None:
        check_text("Instructions", value)
    return value


def _check_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, Mapping) or not all(isinstance(t, Mapping) for t in tools):
        raise InvalidParamsError("tools must be a list of JSON-schema dicts.")
    return [dict(t) for t in tools]


__all__ = ["ChatSession"]
