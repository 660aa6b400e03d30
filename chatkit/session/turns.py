"""``TurnFactory``: a session's turn pipeline (render -> plan -> prefill -> stream -> commit) over its state.

``ChatSession`` (``session.py``) is the public face: it holds a ``SessionState`` (``state.py``), this factory
built over it and the ``Compactor`` (``compaction.py``) the factory makes, and delegates to them. The factory
opens a turn (a typed ``TurnRequest`` to ``Turn.prepare``), settles it and runs the tool loop's rounds;
renders prompts through the context window; checks the window's settings (the KV budget, a context shift's
rotations); binds caches to the prompt cache; and makes the session a summary is written in.
:func:`new_state` makes a new session's state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..cache.prompt import PromptCache
from ..cache.shift import shift_problem
from ..cache.state import CacheOptions, CacheState
from ..decode.batch import BatchEngine
from ..decode.local import fill
from ..decode.sources import source_for
from ..decode.speculative import SpeculativeConfig, vocab_limit
from ..errors import InvalidParamsError
from ..messages import ChatMessage, Role
from ..model import tokenizer as _tokenizer
from ..model.loaded import LoadedModel
from ..model.switchable import ActiveAdapter
from ..model.vision import ImageTable
from ..params import GenerateParams, LogitsProcessor
from ..text.template import ChatTemplate
from .builder import tool_tokenizer
from .compaction import Compactor
from .config import SessionConfig
from .context import ContextPolicy, Fitter, Window, summarizer_for, system_text, window_size
from .conversation import Conversation, pending_calls
from .gate import LoopHold
from .options import TurnOptions
from .results import TurnResult
from .state import SessionState
from .streams import GuidedStream, ResponseStream
from .tool_loop import StrictCalls, ToolLoopStream
from .turn import Prompting, Turn, TurnRequest


def new_state(lm: LoadedModel, config: SessionConfig, history: Sequence[ChatMessage] = ()) -> SessionState:
    """The state of a new session with the checked ``config`` over ``history`` (what cannot be combined
    raises here; the window's settings are checked by the ``TurnFactory`` built over it)."""
    c = config
    images = _image_table(lm, c.speculative, c.engine)
    template = ChatTemplate(tool_tokenizer(lm, c.adapter), c.chat_template, allow_special_in_content=c.allow_special_in_content)
    strict = StrictCalls(template.tokenizer)
    if c.tool_options.strict and c.tools is not None:
        strict.grammar(c.tools)  # a format or schema that cannot be constrained raises here
    source = c.engine.source(c.speculative) if c.engine is not None else source_for(lm.model, lm.distributed, c.speculative)
    return SessionState(lm, c, template, strict, source, Conversation(history, empty_cache(lm, c, c.cache_options)), images)


class TurnFactory:
    """The turns of the session whose state is ``state`` (see the module docstring). Built over a new state,
    it checks the window's settings into it (``InvalidParamsError`` when the context policy cannot shift
    this cache or ``max_kv_bytes`` holds too few tokens) and makes the session's ``compactor``.
    ``new_session(lm, config, history=...)`` makes the session a summary is written in."""

    def __init__(self, state: SessionState, new_session: Callable[..., Any]) -> None:
        self.state, self.new_session = state, new_session
        c = state.config
        state.ropes = self.shift_ropes(c.context_policy, c.cache_options)
        state.budget = self.kv_budget(c.max_kv_bytes, c.cache_options)
        self.compactor = Compactor(  # compactions prepared between turns
            state.gate, lambda: state.conversation, lambda: state.config.context_policy,
            lambda: state.config.generate_params, self.fitter, self.rendered_ids,
            lambda cache, ids: fill(cache, ids, state.lm.model, self.draft_model, state.config.adapter), self.can_prepare,
        )

    def resume(self, cache: CacheState | None, window: Window, earlier: tuple[tuple[int, Window], ...]) -> None:
        """A restored conversation goes on: its history seen through ``window`` (a restored context policy's),
        from ``cache`` when one is restored."""
        s = self.state
        s.conversation = Conversation(s.conversation.messages, s.conversation.cache, window, earlier)
        if cache is not None:
            self.use_cache(cache)

    def guided_turn(self, message: ChatMessage, options: TurnOptions) -> GuidedStream:
        """A turn whose reply is a value (``chatkit.guided``, an extra): the spec's constraint masks it."""
        from ..guided.guide import guide  # the guided extra

        s = self.state
        history = s.conversation.messages
        params = options.turn_params(s.config.generate_params, vocab_limit(s.lm, s.config.speculative))
        message, constraint = guide(message, s.template.tokenizer, lambda m: self.text([*history, m], params), **options.spec,
                                    include_schema=options.include_schema, params=params or s.config.generate_params)
        stream = GuidedStream(self.open_turn(message, constraint=constraint, params=params), constraint)
        s.guided = (message, options.spec)
        return stream

    def regenerate(self) -> ResponseStream | GuidedStream:
        """The last prompt answered again (``ChatSession.stream_regenerate``): after an automatic tool loop
        its last tool result; a guided reply with its spec again; else the last prompt, freely."""
        s = self.state
        strict = s.config.tool_options.strict and s.config.tools is not None
        if self.runs_tools() and s.conversation.ends_with_tool_round():
            return self.open_turn(None, strict=strict)  # the history's last message, a tool result, is answered
        history = s.conversation.messages
        if s.guided is not None and len(history) >= 2 and s.guided[0] == history[-2]:
            from ..guided.guide import guide  # the guided extra

            prompt, spec = s.guided  # the message as sent (its description appended already)

            def render(message: ChatMessage) -> str:
                return self.text([*history[:-2], message])

            _, constraint = guide(prompt, s.template.tokenizer, render, **spec, include_schema=False, params=s.config.generate_params)
            return GuidedStream(self.open_turn(None, regenerate=True, constraint=constraint), constraint)
        return self.open_turn(None, regenerate=True, strict=strict)

    def open_turn(
        self, message: ChatMessage | None, *, regenerate: bool = False, constraint: LogitsProcessor | None = None,
        strict: bool = False, loop: LoopHold | None = None, params: GenerateParams | None = None,
    ) -> ResponseStream:
        """Take the turn and prepare it: answer ``message`` after the history, or (``None``) the
        history's last message (a tool round), or (``regenerate``) the last prompt again; ``constraint``
        (guided output) masks every step after the session's own processors; ``strict`` constrains the
        reply's tool calls (after every other processor). The turn is held until the stream commits or
        aborts. ``loop``: the tool loop this turn is a round of; ``params``: the turn's own settings (checked;
        ``None``: the session's)."""
        s, c = self.state, self.state.config
        params = (params or c.generate_params).copy()
        if constraint is not None:
            params = params.copy(logits_processors=[*params.logits_processors, constraint])
        params.validate(vocab_limit(s.lm, c.speculative))
        constraints = [s.strict.constraint(c.tools, params.stop)] if strict and c.tools is not None else []
        s.gate.take_turn(loop)
        try:
            base, message = s.conversation.prompt_of(message, regenerate)
            prepared = self.compactor.prepared()
            tokenizer = s.template.tokenizer
            turn = Turn.prepare(TurnRequest(
                self.prompting(), self.fitter(params, summaries=not self.compactor.preparer.running), s.conversation,
                base, message, params, s.source, self.settle, _tokenizer.new_detokenizer(tokenizer),
                frozenset(tokenizer.eos_token_ids), context_length=self.context_length,
                progress=c.prefill_progress, constraints=constraints,
                prepared=prepared.compacted if prepared is not None else None, adapter=c.adapter,
                ropes=s.ropes if c.context_policy.shift else None,
            ))
            if prepared is not None and turn.fit is not None and turn.fit.window == prepared.compacted:
                s.conversation.cache = prepared.cache  # its compacted context is prefilled already
                self.compactor.preparer.used()
            return ResponseStream(turn)
        except BaseException:
            s.gate.release()
            raise

    def settle(self, result: TurnResult | None) -> None:
        """A turn ended (committed with ``result``, or aborted): give the turn back."""
        if result is not None:
            self.state.last_stats = result.stats
        self.state.gate.release()
        if result is not None:
            self.compactor.after_turn()

    def tool_loop(self, message: ChatMessage, *, strict: bool = False, params: GenerateParams | None = None) -> ToolLoopStream:
        """The rounds of a reply with tools (``tool_loop``), over this session's turns; with ``strict``
        every round's tool calls are constrained; every round samples with ``params`` (``None``: the session's)."""
        s = self.state
        options, tools = s.config.tool_options, s.config.tools or []
        if strict and s.config.tools is not None:
            s.strict.grammar(s.config.tools)  # before anything changes: a format or schema that cannot be constrained
        waiting = [c for c in pending_calls(s.conversation.messages) if c.id != message.tool_call_id]
        if message.role is Role.TOOL and waiting:  # more results to come: nothing to generate yet
            self.append([message])
            return ToolLoopStream(self.open_turn, self.append, tools, message, generate=False)
        hold = s.gate.hold()
        return ToolLoopStream(
            lambda m: self.open_turn(m, strict=strict, loop=hold, params=params), lambda ms: self.append(ms, loop=hold),
            tools, message, execute=self.runs_tools(), max_rounds=options.max_rounds,
            raise_errors=options.errors == "raise", timeout=options.timeout, on_end=lambda: self.loop_ended(hold),
            images=s.lm.vision is not None,
        )

    def tool_format_for(self, active: ActiveAdapter | None) -> tuple[ChatTemplate, StrictCalls] | None:
        """The template and strict calls of this session with ``active`` as its adapter, when its tool-call
        format differs from the current one (``None``: the same); raises before anything changes when
        strict tools cannot be constrained in the new format."""
        s = self.state
        tokenizer = tool_tokenizer(s.lm, active)
        if tokenizer is s.template.tokenizer:
            return None
        strict = StrictCalls(tokenizer)
        if s.config.tool_options.strict and s.config.tools is not None:
            strict.grammar(s.config.tools)
        template = s.template
        return ChatTemplate(tokenizer, template.template, allow_special_in_content=template.allow_special_in_content), strict

    def use_adapter(self, active: ActiveAdapter | None) -> None:
        """Turns from now on run with ``active`` (``None``: the base model; the caller holds the session
        idle). A change drops the cache (the model that made it is another) and a compaction prepared with
        the old adapter; the tool-call format follows the adapter's (checked before anything changes)."""
        s = self.state
        if (None if active is None else active.key) == (None if s.config.adapter is None else s.config.adapter.key):
            return
        tool_format = self.tool_format_for(active)  # the adapter's tool-call format: raises before changes
        self.compactor.preparer.wait()  # a compaction being prepared with the old adapter: let it end, then drop it
        self.compactor.preparer.discard()
        s.config = replace(s.config, adapter=active)
        if tool_format is not None:
            s.template, s.strict = tool_format
        s.conversation = s.conversation.with_cache(self.new_cache(s.conversation.cache.options))

    def fork_into(self, other: SessionState, messages: Sequence[ChatMessage] | None) -> None:
        """Give a fork's new state (``other``, of the same settings) this conversation and a copy of the cache
        (``messages``: the branch's history instead, over the cache copy), the encoded images, the prompt
        tokenized so far, the last stats and (for the same history) the last guided prompt."""
        s, copied = self.state, self.state.conversation.copy()
        if messages is not None and copied.cache.ledger.shifted:
            copied.cache.reset()  # its keys were rotated past dropped tokens: they hold only for this window
        other.conversation = copied if messages is None else Conversation(messages, copied.cache)
        other.images = s.images.copy() if s.images is not None else None
        other.template.continue_from(s.template)
        other.last_stats = s.last_stats
        other.guided = s.guided if messages is None else None

    def loop_ended(self, hold: LoopHold) -> None:
        """A tool loop is over: the session is free again (and the next compaction may be prepared)."""
        self.state.gate.let_go(hold)
        self.compactor.after_turn()

    def append(self, messages: Sequence[ChatMessage], loop: LoopHold | None = None) -> None:
        """Tool results enter the history (the next round prefills them)."""
        s = self.state
        with s.gate.idle("add tool results", loop):
            s.conversation.record([*s.conversation.messages, *messages], [])

    # -- rendering and the window ----------------------------------------------------------------
    def runs_tools(self) -> bool:
        """Whether replies run an automatic tool loop (so an exchange spans its tool rounds)."""
        c = self.state.config
        return c.tool_options.execution == "auto" and any(t.function is not None for t in c.tools or [])

    def prompting(self, summary: str | None = None) -> Prompting:
        s = self.state
        schemas = None if s.config.tools is None else [t.schema for t in s.config.tools]
        return Prompting(s.template, s.config.instructions, schemas, summary, s.images)

    def text(self, messages: Sequence[ChatMessage], params: GenerateParams | None = None, *,
             add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` through the current window."""
        window = self.state.conversation.window
        return self.prompting(window.summary).text(window.visible(messages), params or self.state.config.generate_params,
                                                   add_generation_prompt=add_generation_prompt)

    def rendered_ids(self, window: Window, messages: Sequence[ChatMessage], params: GenerateParams | None = None, *,
                     add_generation_prompt: bool = False) -> list[int]:
        """The ids of ``messages`` through ``window`` (by default as a finished conversation)."""
        c = self.state.config
        visible = window.visible(messages)
        if not visible and system_text(c.instructions, window.summary) is None:
            return []
        return self.prompting(window.summary).ids(visible, params or c.generate_params,
                                                  add_generation_prompt=add_generation_prompt)

    def fitter(self, params: GenerateParams, *, summaries: bool = True) -> Fitter:
        """How this turn's prompt is fitted into the window (the context policy, the summarizer; without
        ``summaries`` a compaction keeps the summary it has: the fallback while one is being prepared)."""
        def render(window: Window, messages: Sequence[ChatMessage]) -> list[int]:
            return self.rendered_ids(window, messages, params, add_generation_prompt=True)

        s = self.state
        size = window_size(self.context_length, s.conversation.cache.options.max_kv_size)
        summarize = summarizer_for(s.config.context_policy, s.lm, size, self.summary_session) if summaries else None
        return Fitter(s.config.context_policy, size, render, lambda text: len(s.lm.tokenizer.encode(text)), summarize)

    def can_prepare(self) -> bool:
        """Preparations are for policies that compact, in one process (sharded ranks must run in step)."""
        s = self.state
        group, policy = s.lm.distributed, s.config.context_policy
        return (policy.mode != "error" and not policy.shift and not (group is not None and group.sharded)
                and s.images is None)

    @property
    def context_length(self) -> int | None:
        """The window a prompt and its reply must fit: the model's, or the tokens the KV budget holds."""
        return window_size(self.state.lm.context_length, self.state.budget)

    def kv_budget(self, max_kv_bytes: int | None, options: CacheOptions) -> int | None:
        """The tokens ``max_kv_bytes`` of KV cache hold (``None``: no budget); ``InvalidParamsError`` when
        they are too few for the instructions, a short prompt and the reply's room."""
        if max_kv_bytes is None:
            return None
        if isinstance(max_kv_bytes, bool) or not isinstance(max_kv_bytes, int) or max_kv_bytes < 1:
            raise InvalidParamsError(f"max_kv_bytes={max_kv_bytes!r}: use an int of bytes >= 1, or None.")
        per_token = self.state.lm.kv_bytes_per_token(options.kv_bits, options.kv_group_size)
        if per_token == 0:
            return None  # no cache that grows with the context
        tokens = max_kv_bytes // per_token
        c = self.state.config
        needed = len(self.rendered_ids(Window(), [ChatMessage.user("Hi")], add_generation_prompt=True)) + \
            c.context_policy.room(c.generate_params.max_tokens)
        if tokens < needed:
            raise InvalidParamsError(
                f"max_kv_bytes={max_kv_bytes} holds {tokens} tokens of this model's KV cache ({per_token} bytes "
                f"each), fewer than the instructions, a short prompt and its reply's room need ({needed}): give "
                f"at least {needed * per_token} bytes, or shorter instructions or a smaller max_tokens.")
        return tokens

    def shift_ropes(self, policy: ContextPolicy, options: CacheOptions) -> list[Any] | None:
        """Each cache layer's rotation when ``policy`` shifts (``None`` when it does not); a
        ``InvalidParamsError`` naming why when this session cannot shift its cache."""
        if not policy.shift:
            return None
        s = self.state
        why = shift_obstacle(s.lm, options, s.config.speculative, s.config.engine)
        ropes = shift_problem(s.lm.model) if why is None else why
        if isinstance(ropes, str):
            raise InvalidParamsError(f"ContextPolicy.rolling(shift=True) cannot work here: {ropes}. "
                                     "Use ContextPolicy.rolling() (it re-prefills the kept context instead).")
        return ropes

    # -- caches and summaries ---------------------------------------------------------------------
    @property
    def draft_model(self) -> Any:
        return draft_of(self.state.config)

    def use_cache(self, cache: CacheState) -> None:
        """Go on from a restored cache."""
        s = self.state
        cache.shared = shared_prefixes(s.lm, s.config, cache.options)
        if s.images is not None:
            s.images.restore(cache.ledger.tokens, cache.ledger.images)
        s.conversation = s.conversation.with_cache(cache)

    def new_cache(self, options: CacheOptions) -> CacheState:
        """An empty cache built with ``options``, bound to the prompt cache."""
        return empty_cache(self.state.lm, self.state.config, options)

    def summary_session(self, model: LoadedModel, instructions: str | None, history: Sequence[ChatMessage],
                        max_tokens: int) -> Any:
        """The session a context policy's summary is written in: greedy, over the dropped messages."""
        config = SessionConfig(instructions, GenerateParams(max_tokens=max_tokens, temperature=0.0),
                               context_policy=ContextPolicy.rolling())
        return self.new_session(model, config, history=history)


def empty_cache(lm: LoadedModel, config: SessionConfig, options: CacheOptions) -> CacheState:
    """An empty cache of a session over ``lm`` with ``config``, built with ``options``, bound to the prompt cache."""
    cache = CacheState(lm.model, options, draft_of(config))
    cache.shared = shared_prefixes(lm, config, options)
    return cache


def shared_prefixes(lm: LoadedModel, config: SessionConfig, o: CacheOptions) -> Any:
    """The prompt cache bound to what shapes a session's KV (the model's fingerprint, the adapter and its
    scale, the KV quantization); without one, the engine's prefix cache when the session runs on a
    ``BatchEngine`` that has one (and has no adapter: the prefixes there are the base model's)."""
    c = config
    if isinstance(c.prompt_cache, PromptCache):  # (checked: "default" is resolved)
        return c.prompt_cache.bind({
            "model": lm.fingerprint, "adapter": None if c.adapter is None else c.adapter.key,
            "kv": [o.kv_bits, o.kv_group_size, o.quantized_kv_start] if o.kv_bits is not None else None,
        })
    return None if c.engine is None or c.adapter is not None else c.engine.prefix_cache


def draft_of(config: SessionConfig) -> Any:
    """The draft model of a session's speculative decoding (``None``: none)."""
    draft = config.speculative.draft_model if config.speculative is not None else None
    return draft.model if draft is not None else None


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


__all__ = ["TurnFactory", "new_state", "shift_obstacle"]
