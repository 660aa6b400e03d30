"""``Turn``: one turn of a session, as explicit steps.

    prepare   render the conversation + the new message to ids through the conversation's window,
              compacted when the context policy says (``context.py``); check the context window
    start     plan the cache's reuse, prefill the suffix and generate, through a token source
    commit    the conversation takes the message and the reply, the cache what it was fed
    abort     nothing changes but what the cache provably holds

A :class:`~chatkit.session.streams.ResponseStream` drives the last three and calls exactly one of commit or
abort; ``settle`` hands the turn back to its session either way. A tool round is one more turn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..cache.planner import Plan
from ..decode import DraftCount, ProgressCallback, Request, Token, TokenSource
from ..errors import ContextWindowExceededError, InvalidMessageError
from ..images import Image, ImageSpan
from ..messages import ChatMessage
from ..model.switchable import ActiveAdapter
from ..model.vision import ImageTable
from ..params import GenerateParams, LogitsProcessor
from ..text.images import expand, locate
from ..text.reply import Segmenter
from ..text.template import ChatTemplate
from ..text.thinking import ThinkingBudget
from .context import Fit, Fitter, Window, system_text
from .conversation import Conversation
from .results import TurnResult


@dataclass(frozen=True)
class Prompting:
    """How a session renders: its template, instructions and tools (and the summary of what a context
    policy dropped, shown after the instructions)."""

    template: ChatTemplate
    instructions: str | None
    tools: Sequence[Mapping[str, Any]] | None
    summary: str | None = None
    vision: ImageTable | None = None  # a vision-language model's images (None: the model reads no images)

    def ids(self, messages: Sequence[ChatMessage], params: GenerateParams, *, add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of ``messages`` after the instructions (each image's placeholder expanded to its
        tokens)."""
        images = self.images(messages)
        vision = self.vision.vision if self.vision is not None else None
        ids = self.template.encode(
            self._with_system(messages), tools=self.tools, add_generation_prompt=add_generation_prompt,
            template_kwargs=params.chat_template_kwargs(), rewrite=vision.rewrite if vision is not None else None,
        )
        if not images or self.vision is None or self.vision.vision.expansion is not None:
            return ids  # (an expansion wrote the image tokens already)
        return expand(ids, images, self.vision.placeholder, self.vision.ids)

    def images(self, messages: Sequence[ChatMessage]) -> list[Image]:
        """The images ``messages`` show, in order; ``InvalidMessageError`` when the model reads none or
        there are more than it takes."""
        images = [image for m in messages for image in m.images]
        if images and self.vision is None:
            raise InvalidMessageError("This model reads no images: load a vision-language model to send images.")
        if self.vision is not None and len(images) > self.vision.vision.max_images:
            raise InvalidMessageError(
                f"The conversation shows {len(images)} images, more than this model takes in one prompt "
                f"({self.vision.vision.max_images}): start a new conversation or send fewer images."
            )
        return images

    def text(self, messages: Sequence[ChatMessage], params: GenerateParams, *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` after the instructions."""
        return self.template.render(
            self._with_system(messages), tools=self.tools, add_generation_prompt=add_generation_prompt,
            template_kwargs=params.chat_template_kwargs(),
        )

    def _with_system(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        text = system_text(self.instructions, self.summary)
        system = [ChatMessage.system(text)] if text is not None else []
        return [*system, *messages]


def fitted(fitter: Fitter, conversation: Conversation, base: Sequence[ChatMessage], message: ChatMessage,
           params: GenerateParams, context_length: int | None, prepared: Window | None = None) -> tuple[Fit, int]:
    """The prompt of ``message`` after ``base`` fitted into the conversation's window, and the tokens the
    model sees (the cache's opaque prefix + the prompt): ``ContextWindowExceededError`` when it does not
    fit. A turn's first step, and all of ``ChatSession.check_fits``."""
    opaque = conversation.cache.ledger.opaque  # a restored raw cache stays in front
    room = fitter.policy.room(params.max_tokens)
    fit = fitter.fit(conversation.window, base, message, room=room, opaque=opaque, prepared=prepared)
    needed = opaque + len(fit.prompt)
    if context_length is not None and needed >= context_length:
        raise ContextWindowExceededError(
            f"The prompt is {needed} tokens but the model's context window is {context_length}: "
            "shorten the conversation (e.g. clear(), or a context policy: builder.context_policy(...)).",
            prompt_tokens=needed,
            context_length=context_length,
        )
    return fit, needed


@dataclass
class Turn:
    """One prepared turn: answer ``message`` after ``base`` (see the module docstring)."""

    conversation: Conversation
    source: TokenSource
    base: tuple[ChatMessage, ...]
    message: ChatMessage
    params: GenerateParams
    prompt: list[int]  # the rendered prompt's ids, after the cache's opaque prefix
    prompt_tokens: int  # what the model sees: opaque prefix + prompt
    max_tokens: int
    settle: Callable[[TurnResult | None], None]
    progress: ProgressCallback | None
    detokenizer: Any
    eos_token_ids: frozenset[int]
    segmenter: Segmenter
    stop: Sequence[str] = ()
    constraints: Sequence[LogitsProcessor] = ()  # applied last, after the thinking budget (strict tool calls)
    drafts: DraftCount = field(default_factory=DraftCount)  # what a speculative source drafted
    plan: Plan | None = None
    fed: list[int] = field(default_factory=list)
    fit: Fit | None = None  # the window this turn's prompt was rendered through, and what compacting did
    adapter: ActiveAdapter | None = None  # the session's adapter: part of what shapes this turn's KV
    vision: ImageTable | None = None  # a vision-language model's images (encoded once per session)
    images: tuple[ImageSpan, ...] = ()  # where the prompt's images are
    ropes: Sequence[Any] | None = None  # each cache layer's rotation when the policy shifts the cache
    shifted: int = 0  # tokens a context shift dropped from the cache for this turn

    @classmethod
    def prepare(
        cls,
        prompting: Prompting,
        fitter: Fitter,
        conversation: Conversation,
        base: Sequence[ChatMessage],
        message: ChatMessage,
        params: GenerateParams,
        *,
        context_length: int | None,
        prepared: Window | None = None,
        **rest: Any,
    ) -> Turn:
        """Render the prompt through the conversation's window, compacted when the policy says (through
        ``prepared``, a compaction made ahead, when it fits); check it: ``ContextWindowExceededError`` if
        it does not fit."""
        fit, needed = fitted(fitter, conversation, base, message, params, context_length, prepared)
        prompt = fit.prompt
        room = params.max_tokens if context_length is None else min(params.max_tokens, context_length - needed)
        segmenter = Segmenter(prompting.template.tokenizer, stop=params.stop, prompt=prompt, tools=prompting.tools)
        images: tuple[ImageSpan, ...] = ()
        if prompting.vision is not None:
            shown = prompting.images(fit.window.visible([*base, message]))
            images = locate(prompt, shown, prompting.vision.placeholder, prompting.vision.ids, prompting.vision.layout)
        return cls(
            conversation, base=tuple(base), message=message, params=params, prompt=prompt,
            prompt_tokens=needed, max_tokens=room, stop=tuple(params.stop), segmenter=segmenter, fit=fit,
            vision=prompting.vision, images=images, **rest,
        )

    def start(self) -> tuple[int, Iterator[Token]]:
        """Plan reuse, then prefill and generate through the token source; (tokens prefilled, tokens)."""
        if self.params.seed is not None:
            mx.random.seed(self.params.seed)
        cache = self.conversation.cache
        if self.vision is not None:  # before anything changes: pixels a restored session does not have
            self.vision.check(self.images, cache.preview(self.prompt, self.images))
        if self.ropes is not None and self.fit is not None and self.fit.compacted and \
                cache.shift(self.prompt, self.fit.dropped_tokens, self.ropes):
            self.shifted = self.fit.dropped_tokens
        self.plan = cache.prepare(self.prompt, self.images)
        embeddings, model = None, None
        if self.vision is not None:
            embeddings, model = self.vision.inputs(self.prompt, self.images, self.plan.keep)
        self.fed.extend(self.plan.suffix)
        request = Request(
            suffix=self.plan.suffix,
            context=cache.ledger.tokens,
            max_tokens=self.max_tokens,
            sampler=self.params.make_sampler(),
            logits_processors=[*self.params.make_logits_processors(), *self._thinking_budget(), *self.constraints],
            options=cache.options,
            progress=self._on_progress,
            drafts=self.drafts,
            adapter=self.adapter,
            embeddings=embeddings,
            model=model,
        )
        return len(self.plan.suffix), self.source.generate(cache, request)

    def commit(self, result: TurnResult) -> None:
        """The conversation takes the message and the reply; the cache what was fed and generated."""
        try:
            reply = ChatMessage.assistant(result.text, reasoning=result.reasoning, tool_calls=result.tool_calls)
            window = self.fit.window if self.fit is not None else None
            self.conversation.record([*self.base, self.message, reply], [*self.fed, *result.tokens], window)
        finally:
            self.settle(result)

    def abort(self, exc: BaseException | None = None, generated: Sequence[int] = ()) -> None:
        """Nothing changes but the cache, which keeps what it provably holds of the prompt and of the
        ``generated`` tokens (the next turn trims those back), or is dropped."""
        try:
            self.conversation.keep_cache([*self.fed, *generated])
        finally:
            self.settle(None)

    def _thinking_budget(self) -> list[ThinkingBudget]:
        """The end-of-thinking forcer when ``max_thinking_tokens`` is set and the model thinks."""
        budget, tokenizer = self.params.max_thinking_tokens, self.segmenter.tokenizer
        if budget is None or not getattr(tokenizer, "has_thinking", False) or not tokenizer.think_end_tokens:
            return []
        return [ThinkingBudget(tokenizer, budget, start_in_reasoning=self.segmenter.state == "reasoning",
                               prompt_length=len(self.prompt))]

    def _on_progress(self, done: int, total: int) -> None:
        if done == total - 1:  # the whole prompt but its last token is in: a rewind point
            self.conversation.cache.checkpoint()
        if self.progress is not None:
            self.progress(done, total)


__all__ = ["Prompting", "Turn", "fitted"]
