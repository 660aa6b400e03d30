"""``SessionCore``: a session's state and its turn pipeline (render -> plan -> prefill -> stream -> commit).

``ChatSession`` is the public face over it (``session.py``); this is what opens a turn, settles it and
runs the tool loop's rounds, and how prompts are rendered through the context window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import Self

from ..cache.prompt import PromptCache
from ..cache.shift import shift_problem
from ..cache.state import CacheOptions, CacheState
from ..decode import TokenSource
from ..decode.batch import BatchEngine
from ..decode.local import fill
from ..decode.sources import source_for
from ..decode.speculative import SpeculativeConfig, vocab_limit
from ..errors import ChatKitError, InvalidParamsError
from ..messages import ChatMessage, Role
from ..model import tokenizer as _tokenizer
from ..model.loaded import LoadedModel
from ..model.switchable import ActiveAdapter
from ..model.vision import ImageTable
from ..params import GenerateParams, LogitsProcessor
from ..text.template import ChatTemplate
from .builder import tool_tokenizer
from .compaction import Prepared, Preparer, Snapshot
from .config import SessionConfig
from .context import ContextPolicy, Fitter, Window, summarizer_for, system_text, window_size
from .conversation import Conversation, pending_calls
from .gate import LoopHold, TurnGate
from .options import TurnOptions
from .results import TurnResult, TurnStats
from .streams import GuidedStream, ResponseStream
from .tool_loop import StrictCalls, ToolLoopStream
from .turn import Prompting, Turn


class SessionCore:
    """The state of a session and its turn pipeline (see the module docstring); use ``ChatSession``."""

    def __init__(self, lm: LoadedModel, config: SessionConfig | None = None, *, history: Sequence[ChatMessage] = (),
                 **settings: Any) -> None:
        """Prefer :meth:`builder`, which also restores saved caches. ``config`` (default: the defaults) with
        ``settings`` (``SessionConfig`` field names, e.g. ``instructions=``) over it; all checked here."""
        if not isinstance(lm, LoadedModel):
            raise InvalidParamsError(f"A session needs a chatkit.load(...) result, got {type(lm).__name__}.")
        self._lm = lm
        self._config = c = SessionConfig.of(config, settings).checked(lm)
        self._images = _image_table(lm, c.speculative, c.engine)
        self._template = ChatTemplate(tool_tokenizer(lm, c.adapter), c.chat_template,
                                      allow_special_in_content=c.allow_special_in_content)
        self._strict = StrictCalls(self._template.tokenizer)
        if c.tool_options.strict and c.tools is not None:
            self._strict.grammar(c.tools)  # a format or schema that cannot be constrained raises here
        self._source: TokenSource = (
            c.engine.source(c.speculative) if c.engine is not None else source_for(lm.model, lm.distributed, c.speculative)
        )
        self._conversation = Conversation(history, self._new_cache(c.cache_options))
        self._ropes, self._budget = self._shift_ropes(c.context_policy, c.cache_options), self._kv_budget(c.max_kv_bytes, c.cache_options)
        self._gate, self._preparer = TurnGate(), Preparer()
        self._between_turns: Callable[[Callable[[], None]], None] | None = None  # runs work between turns (a pool's)
        self._last_stats: TurnStats | None = None
        self._guided: tuple[ChatMessage, dict[str, Any]] | None = None  # the last guided prompt and its spec

    @classmethod
    def _start(cls, lm: LoadedModel, config: SessionConfig, history: Sequence[ChatMessage] = (),
               cache: CacheState | None = None, window: Window = Window(), earlier: tuple[tuple[int, Window], ...] = ()) -> Self:
        """The session a builder describes: ``config`` over ``history`` (seen through ``window``, a restored
        context policy's), going on from ``cache`` when one is restored."""
        session = cls(lm, config, history=history)
        session._conversation = Conversation(session._conversation.messages, session._conversation.cache, window, earlier)
        if cache is not None:
            session._use_cache(cache)
        return session

    def _guided_turn(self, message: ChatMessage, options: TurnOptions) -> GuidedStream:
        """A turn whose reply is a value (``chatkit.guided``, an extra): the spec's constraint masks it."""
        from ..guided.guide import guide  # the guided extra

        history = self._conversation.messages
        params = options.turn_params(self._config.generate_params, vocab_limit(self._lm, self._config.speculative))
        message, constraint = guide(message, self._template.tokenizer, lambda m: self._text([*history, m], params), **options.spec,
                                    include_schema=options.include_schema, params=params or self._config.generate_params)
        stream = GuidedStream(self._open_turn(message, constraint=constraint, params=params), constraint)
        self._guided = (message, options.spec)
        return stream

    def _open_turn(
        self, message: ChatMessage | None, *, regenerate: bool = False, constraint: LogitsProcessor | None = None,
        strict: bool = False, loop: LoopHold | None = None, params: GenerateParams | None = None,
    ) -> ResponseStream:
        """Take the turn and prepare it: answer ``message`` after the history, or (``None``) the
        history's last message (a tool round), or (``regenerate``) the last prompt again; ``constraint``
        (guided output) masks every step after the session's own processors; ``strict`` constrains the
        reply's tool calls (after every other processor). The turn is held until the stream commits or
        aborts. ``loop``: the tool loop this turn is a round of; ``params``: the turn's own settings (checked;
        ``None``: the session's)."""
        params = (params or self._config.generate_params).copy()
        if constraint is not None:
            params = params.copy(logits_processors=[*params.logits_processors, constraint])
        params.validate(vocab_limit(self._lm, self._config.speculative))
        constraints = [self._strict.constraint(self._config.tools, params.stop)] if strict and self._config.tools is not None else []
        self._gate.take_turn(loop)
        try:
            base, message = self._conversation.prompt_of(message, regenerate)
            prepared = self._prepared()
            tokenizer = self._template.tokenizer
            turn = Turn.prepare(
                self._prompting(), self._fitter(params, summaries=not self._preparer.running), self._conversation,
                base, message, params, context_length=self._context_length, source=self._source,
                settle=self._settle, progress=self._config.prefill_progress, detokenizer=_tokenizer.new_detokenizer(tokenizer),
                eos_token_ids=frozenset(tokenizer.eos_token_ids), constraints=constraints,
                prepared=prepared.compacted if prepared is not None else None, adapter=self._config.adapter,
                ropes=self._ropes if self._config.context_policy.shift else None,
            )
            if prepared is not None and turn.fit is not None and turn.fit.window == prepared.compacted:
                self._conversation.cache = prepared.cache  # its compacted context is prefilled already
                self._preparer.used()
            return ResponseStream(turn)
        except BaseException:
            self._gate.release()
            raise

    def _settle(self, result: TurnResult | None) -> None:
        """A turn ended (committed with ``result``, or aborted): give the turn back."""
        if result is not None:
            self._last_stats = result.stats
        self._gate.release()
        if result is not None:
            self._prepare_between_turns()

    def _tool_loop(self, message: ChatMessage, *, strict: bool = False, params: GenerateParams | None = None) -> ToolLoopStream:
        """The rounds of a reply with tools (``tool_loop``), over this session's turns; with ``strict``
        every round's tool calls are constrained; every round samples with ``params`` (``None``: the session's)."""
        options, tools = self._config.tool_options, self._config.tools or []
        if strict and self._config.tools is not None:
            self._strict.grammar(self._config.tools)  # before anything changes: a format or schema that cannot be constrained
        waiting = [c for c in pending_calls(self._conversation.messages) if c.id != message.tool_call_id]
        if message.role is Role.TOOL and waiting:  # more results to come: nothing to generate yet
            self._append([message])
            return ToolLoopStream(self._open_turn, self._append, tools, message, generate=False)
        hold = self._gate.hold()
        return ToolLoopStream(
            lambda m: self._open_turn(m, strict=strict, loop=hold, params=params), lambda ms: self._append(ms, loop=hold),
            tools, message, execute=self._runs_tools(), max_rounds=options.max_rounds,
            raise_errors=options.errors == "raise", timeout=options.timeout, on_end=lambda: self._loop_ended(hold),
            images=self._lm.vision is not None,
        )

    def _tool_format_for(self, active: ActiveAdapter | None) -> tuple[ChatTemplate, StrictCalls] | None:
        """The template and strict calls of this session with ``active`` as its adapter, when its tool-call
        format differs from the current one (``None``: the same); raises before anything changes when
        strict tools cannot be constrained in the new format."""
        tokenizer = tool_tokenizer(self._lm, active)
        if tokenizer is self._template.tokenizer:
            return None
        strict = StrictCalls(tokenizer)
        if self._config.tool_options.strict and self._config.tools is not None:
            strict.grammar(self._config.tools)
        template = self._template
        return ChatTemplate(tokenizer, template.template, allow_special_in_content=template.allow_special_in_content), strict

    def _loop_ended(self, hold: LoopHold) -> None:
        """A tool loop is over: the session is free again (and the next compaction may be prepared)."""
        self._gate.let_go(hold)
        self._prepare_between_turns()

    def _append(self, messages: Sequence[ChatMessage], loop: LoopHold | None = None) -> None:
        """Tool results enter the history (the next round prefills them)."""
        with self._gate.idle("add tool results", loop):
            self._conversation.record([*self._conversation.messages, *messages], [])

    # -- internals ------------------------------------------------------------------------------
    def _runs_tools(self) -> bool:
        """Whether replies run an automatic tool loop (so an exchange spans its tool rounds)."""
        tools = self._config.tools or []
        return self._config.tool_options.execution == "auto" and any(t.function is not None for t in tools)

    def _prompting(self, summary: str | None = None) -> Prompting:
        schemas = None if self._config.tools is None else [t.schema for t in self._config.tools]
        return Prompting(self._template, self._config.instructions, schemas, summary, self._images)

    def _text(self, messages: Sequence[ChatMessage], params: GenerateParams | None = None, *,
              add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` through the current window."""
        window = self._conversation.window
        return self._prompting(window.summary).text(window.visible(messages), params or self._config.generate_params,
                                                    add_generation_prompt=add_generation_prompt)

    def _rendered_ids(self, window: Window, messages: Sequence[ChatMessage], params: GenerateParams | None = None, *,
                      add_generation_prompt: bool = False) -> list[int]:
        """The ids of ``messages`` through ``window`` (by default as a finished conversation)."""
        visible = window.visible(messages)
        if not visible and system_text(self._config.instructions, window.summary) is None:
            return []
        return self._prompting(window.summary).ids(visible, params or self._config.generate_params,
                                                   add_generation_prompt=add_generation_prompt)

    def _fitter(self, params: GenerateParams, *, summaries: bool = True) -> Fitter:
        """How this turn's prompt is fitted into the window (the context policy, the summarizer; without
        ``summaries`` a compaction keeps the summary it has: the fallback while one is being prepared)."""
        def render(window: Window, messages: Sequence[ChatMessage]) -> list[int]:
            return self._rendered_ids(window, messages, params, add_generation_prompt=True)

        size = window_size(self._context_length, self._conversation.cache.options.max_kv_size)
        summarize = summarizer_for(self._config.context_policy, self._lm, size, self._summary_session) if summaries else None
        return Fitter(self._config.context_policy, size, render, lambda text: len(self._lm.tokenizer.encode(text)), summarize)

    def _prepared(self) -> Prepared | None:
        """The compaction prepared for this conversation as it is, if any (``fallback="wait"``: after the
        preparation running now has ended)."""
        if self._preparer.running:
            if self._config.context_policy.fallback != "wait":
                return None  # still being made (its cache too): this turn compacts by itself
            self._preparer.wait()
        return self._preparer.get(self._conversation.messages, self._conversation.window)

    def _claim_preparation(self) -> Callable[[], None] | None:
        """After an async turn, before its caller hears of the end: claim the next compaction's preparation
        and take its snapshot (so the next turn waits for it, or knows it is coming), and return the work,
        which runs between turns. A failure there is the next turn's to report (it compacts by itself, and
        a summarizer that fails raises then, changing nothing)."""
        try:
            snapshot = self._claim()
        except ChatKitError:
            return None
        if snapshot is None:
            return None

        def work() -> None:
            try:
                self._prepare_from(snapshot)
            except ChatKitError:
                pass
        return work

    def _prepare_between_turns(self) -> None:
        """When a pool runs this session's work between turns (``_between_turns``): claim the next
        compaction's preparation now, as the turn ends (so a turn that comes next knows it is coming),
        and hand the work over. Never raises: the turn has committed, and the next one compacts by itself."""
        run = self._between_turns
        if run is None or self._gate.busy:  # a tool loop between its rounds: prepared once it ends
            return
        try:
            work = self._claim_preparation()
        except Exception:  # a preparation is only a saving
            return
        if work is not None:
            try:
                run(work)
            except Exception:  # it will not run: the next turn must not wait for it
                self._preparer.finish(None)

    def _can_prepare(self) -> bool:
        """Preparations are for policies that compact, in one process (sharded ranks must run in step)."""
        group = self._lm.distributed
        return (self._config.context_policy.mode != "error" and not self._config.context_policy.shift and not (group is not None and group.sharded)
                and self._images is None)

    def _prepare_compaction(self) -> bool:
        """See ``ChatSession.prepare_compaction``."""
        snapshot = self._claim()
        return False if snapshot is None else self._prepare_from(snapshot)

    def _claim(self) -> Snapshot | None:
        """Claim the next compaction's preparation and take its snapshot: ``None`` when there is nothing to
        prepare or one is running (a snapshot that fails releases the claim and raises)."""
        if not self._can_prepare() or not self._preparer.start():
            return None
        try:
            return self._snapshot()
        except BaseException:
            self._preparer.finish(None)
            raise

    def _snapshot(self) -> Snapshot:
        """What a preparation works on, taken while no turn runs; its own work does not hold the session."""
        with self._gate.idle("prepare a compaction"):
            c = self._conversation
            earlier = self._preparer.get(c.messages, c.window)
            spare = earlier.cache if earlier is not None else c.cache.copy()
            return Snapshot(c.messages, c.window, self._config.generate_params.copy(), earlier, spare)

    def _prepare_from(self, s: Snapshot) -> bool:
        """Prepare from a snapshot (a still good preparation: only top its cache up with the exchanges
        since); the preparer is told the outcome whatever happens."""
        prepared = None
        try:
            compacted = s.earlier.compacted if s.earlier is not None else (
                self._fitter(s.params).ahead(s.window, s.messages, s.spare.ledger.opaque, self._config.context_policy.room(s.params.max_tokens)))
            ids = self._rendered_ids(compacted, s.messages, s.params) if compacted is not None else []
            if compacted is not None and ids:  # (a conversation compacted to nothing has no prompt to prefill)
                fill(s.spare, ids, self._lm.model, self._draft_model, self._config.adapter)
                prepared = Prepared(s.messages, s.window, compacted, s.spare)
            return prepared is not None
        finally:
            self._preparer.finish(prepared)

    @property
    def _context_length(self) -> int | None:
        """The window a prompt and its reply must fit: the model's, or the tokens the KV budget holds."""
        return window_size(self._lm.context_length, self._budget)

    def _kv_budget(self, max_kv_bytes: int | None, options: CacheOptions) -> int | None:
        """The tokens ``max_kv_bytes`` of KV cache hold (``None``: no budget); ``InvalidParamsError`` when
        they are too few for the instructions, a short prompt and the reply's room."""
        if max_kv_bytes is None:
            return None
        if isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int) or max_kv_bytes < 1:
            raise InvalidParamsError(f"max_kv_bytes={max_kv_bytes!r}: use an int of bytes >= 1, or None.")
        per_token = self._lm.kv_bytes_per_token(options.kv_bits, options.kv_group_size)
        if per_token == 0:
            return None  # no cache that grows with the context
        tokens = max_kv_bytes // per_token
        needed = len(self._rendered_ids(Window(), [ChatMessage.user("Hi")], add_generation_prompt=True)) + \
            self._config.context_policy.room(self._config.generate_params.max_tokens)
        if tokens < needed:
            raise InvalidParamsError(
                f"max_kv_bytes={max_kv_bytes} holds {tokens} tokens of this model's KV cache ({per_token} bytes "
                f"each), fewer than the instructions, a short prompt and its reply's room need ({needed}): give "
                f"at least {needed * per_token} bytes, or shorter instructions or a smaller max_tokens.")
        return tokens

    def _shift_ropes(self, policy: ContextPolicy, options: CacheOptions) -> list[Any] | None:
        """Each cache layer's rotation when ``policy`` shifts (``None`` when it does not); a
        ``InvalidParamsError`` naming why when this session cannot shift its cache."""
        if not policy.shift:
            return None
        why = shift_obstacle(self._lm, options, self._config.speculative, self._config.engine)
        ropes = shift_problem(self._lm.model) if why is None else why
        if isinstance(ropes, str):
            raise InvalidParamsError(f"ContextPolicy.rolling(shift=True) cannot work here: {ropes}. "
                                     "Use ContextPolicy.rolling() (it re-prefills the kept context instead).")
        return ropes

    @property
    def _draft_model(self) -> Any:
        draft = self._config.speculative.draft_model if self._config.speculative is not None else None
        return draft.model if draft is not None else None

    def _use_cache(self, cache: CacheState) -> None:
        """Go on from a restored cache."""
        cache.shared = self._shared_prefixes(cache.options)
        if self._images is not None:
            self._images.restore(cache.ledger.tokens, cache.ledger.images)
        self._conversation = self._conversation.with_cache(cache)

    def _new_cache(self, options: CacheOptions) -> CacheState:
        cache = CacheState(self._lm.model, options, self._draft_model)
        cache.shared = self._shared_prefixes(options)
        return cache

    def _shared_prefixes(self, o: CacheOptions) -> Any:
        """The prompt cache bound to what shapes this session's KV (the model's fingerprint, the adapter and
        its scale, the KV quantization); without one, the engine's prefix cache when the session runs on a
        ``BatchEngine`` that has one (and has no adapter: the prefixes there are the base model's)."""
        c = self._config
        if isinstance(c.prompt_cache, PromptCache):  # (checked: "default" is resolved)
            return c.prompt_cache.bind({
                "model": self._lm.fingerprint, "adapter": None if c.adapter is None else c.adapter.key,
                "kv": [o.kv_bits, o.kv_group_size, o.quantized_kv_start] if o.kv_bits is not None else None,
            })
        return None if c.engine is None or c.adapter is not None else c.engine.prefix_cache

    def _summary_session(self, model: LoadedModel, instructions: str | None, history: Sequence[ChatMessage],
                         max_tokens: int) -> SessionCore:
        """The session a context policy's summary is written in: greedy, over the dropped messages."""
        config = SessionConfig(instructions, GenerateParams(max_tokens=max_tokens, temperature=0.0),
                               context_policy=ContextPolicy.rolling())
        return type(self)(model, config, history=history)


def _image_table(lm: LoadedModel, speculative: SpeculativeConfig | None, engine: BatchEngine | None) -> ImageTable | None:
    """A vision-language model's table of the session's images; what such a session cannot combine with."""
    if lm.vision is None:
        return None
    if speculative is not None or engine is not None:
        raise InvalidParamsError("A vision-language model runs its sessions alone: no speculative decoding or batch engine.")
    return ImageTable(lm.vision)


def shift_obstacle(lm: LoadedModel, options: CacheOptions, speculative: SpeculativeConfig | None,
                   engine: BatchEngine | None) -> str | None:
    """Why a session's settings rule out a context shift (before the model's own layers are looked at)."""
    if lm.vision is not None:
        return "a vision-language model places its tokens with multimodal (M-RoPE) positions"
    if lm.distributed is not None and lm.distributed.sharded:
        return "a sharded model's ranks would have to shift in step"
    if options.kv_bits is not None:
        return f"a quantized KV cache (kv_bits={options.kv_bits}) cannot be re-rotated without requantizing it"
    if options.max_kv_size is not None:
        return f"a rotating cache (max_kv_size={options.max_kv_size}) evicts tokens by itself"
    if speculative is not None or engine is not None:
        return "a draft model's or batch engine's cache would have to shift too"
    return None


__all__ = ["SessionCore"]
