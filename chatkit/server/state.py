"""What every handler shares: the config, the model and, while the app runs, the session index, the
response store and the limiter; and how a handler opens a turn on them and settles it."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from ..cache.prompt import PromptCache, default_prompt_cache
from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig
from ..errors import InvalidParamsError
from ..messages import ChatMessage
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..model.tokenizer import with_tool_parser
from ..params import GenerateParams
from ..session.context import ContextPolicy
from ..text import reply as segments
from . import trace
from .errors import BadRequestError, OverloadedError
from .lease import Lease
from .metrics import Metrics
from .models import Selection, ServedModels
from .response_store import ResponseStore
from .session_index import SessionIndex
from .tool_choice import call_constraint
from .wire import TurnRequest


@dataclass
class ServerConfig:
    """How ``chatkit serve`` runs. ``store``: a folder where conversations and responses outlive the
    process (``None``: a temporary folder, forgotten at exit). ``parallel`` turns generate at once (with
    ``batch``, decoded together by one ``chatkit.BatchEngine``: one forward pass per step for all of
    them, more throughput for many clients, some latency for one) and ``queue`` more may wait;
    beyond that, 503. ``api_key``: require ``Authorization: Bearer KEY``. ``context_policy``: what a
    conversation does when it outgrows the context window (``chatkit serve --context-policy``).
    ``adapters``: LoRA/DoRA adapters by name (a ``chatkit.Adapter`` or an adapter folder's path), each
    served as the model ``<model_id>:<name>`` over the one loaded model (``chatkit serve --adapter``;
    see ``models``)."""

    model_id: str = "chatkit"
    store: str | None = None
    max_cache_bytes: int = 2 * 2**30
    max_conversations: int = 256
    parallel: int = 2
    queue: int = 32
    batch: bool = False
    api_key: str | None = None
    defaults: GenerateParams = field(default_factory=lambda: GenerateParams(max_tokens=512))
    speculative: SpeculativeConfig | None = None
    context_policy: ContextPolicy = field(default_factory=ContextPolicy.rolling)
    adapters: Mapping[str, Adapter | str | os.PathLike[str]] = field(default_factory=dict)
    max_kv_bytes: int | None = None
    """Each conversation's KV budget (``chatkit serve --max-kv-bytes``): its window becomes the tokens that
    fit, and the context policy works at that window."""
    prompt_cache: PromptCache | None | str = "default"
    """KV blocks shared by every conversation (``chatkit serve --prompt-cache``): ``"default"``, the model's
    process-wide prompt cache (RAM only); ``None``: off."""


class Limiter:
    """At most ``parallel`` turns at once and ``queue`` waiting; more is ``OverloadedError`` (503)."""

    def __init__(self, parallel: int, queue: int) -> None:
        self._slots = asyncio.Semaphore(parallel)
        self._room = parallel + queue
        self._inside = 0

    async def acquire(self) -> None:
        if self._inside >= self._room:
            raise OverloadedError("The server is busy with other requests: retry in a moment.")
        self._inside += 1
        try:
            await self._slots.acquire()
        except BaseException:
            self._inside -= 1
            raise

    def release(self) -> None:
        self._inside -= 1
        self._slots.release()


class ServerState:
    """The model and config of one app, and what :meth:`lifespan` builds for as long as it runs."""

    sessions: SessionIndex
    responses: ResponseStore
    limiter: Limiter

    def __init__(self, lm: LoadedModel, config: ServerConfig) -> None:
        self.lm, self.config = lm, config
        self.models = ServedModels(lm, config.model_id, config.adapters)  # a bad adapter: no app
        self.metrics = Metrics()
        sharded = lm.distributed is not None and lm.distributed.sharded  # (its ranks must prefill alike: none)
        chosen = None if sharded else default_prompt_cache(lm) if config.prompt_cache == "default" else config.prompt_cache
        if chosen is not None and not isinstance(chosen, PromptCache):
            raise InvalidParamsError(f"ServerConfig.prompt_cache takes a chatkit.PromptCache, None or 'default', got "
                                     f"{chosen!r}.")
        self.prompt_cache: PromptCache | None = chosen
        self.started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The session index and response store in ``config.store`` (else a temporary folder), the
        batch engine with ``config.batch``; the conversations are saved and the engine closed at the end."""
        config, lm = self.config, self.lm
        with contextlib.ExitStack() as stack:
            if config.store is not None:
                root = Path(config.store)
            else:
                root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chatkit-serve-")))
            engine = None
            if config.batch and not (lm.distributed is not None and lm.distributed.sharded):
                engine = BatchEngine(lm, max_batch=config.parallel)
                stack.callback(engine.close)
            app.state.engine = engine  # what RunningServer.engine shows
            self.sessions = SessionIndex(
                lm, folder=root, max_cache_bytes=config.max_cache_bytes, max_conversations=config.max_conversations,
                defaults=config.defaults, speculative=config.speculative, persist=config.store is not None,
                engine=engine, context_policy=config.context_policy, adapters=self.models.adapters,
                prompt_cache=self.prompt_cache, max_kv_bytes=config.max_kv_bytes,
            )
            self.responses = ResponseStore(root / "responses" if config.store is not None else None, run=self.sessions.run)
            self.limiter = Limiter(config.parallel, config.queue)
            try:
                yield
            finally:
                await self.sessions.close()

    async def open_turn(self, req: TurnRequest, instructions: str | None, history: Sequence[ChatMessage],
                        added: Sequence[ChatMessage], *, keep: bool = True, model: Selection | None = None) -> Lease:
        """Take a slot and open a turn answering ``added`` after ``instructions`` + ``history`` with the
        request's settings, on the model it selects (``model``: already selected); :meth:`settled`
        closes it and frees the slot."""
        model = model if model is not None else self.models.select(req.model)
        trace.stamp("parsed")
        params = req.params
        adapter = self.models.adapters[model.adapter] if model.adapter is not None else None
        tokenizer = with_tool_parser(self.lm.tokenizer, adapter.tool_parser_type if adapter is not None else None)
        if req.tools and req.tool_choice == "none":
            params = params.copy(logit_bias={**(params.logit_bias or {}), **_no_tool_calls(tokenizer)})
        if req.schema is not None and req.tools and req.tool_choice == "required":
            raise BadRequestError("tool_choice: a reply with a response format is a value and calls no tools: "
                                  "drop one of them.", param="tool_choice")
        held = call_constraint(tokenizer, req.tools, req.tool_choice, req.tool_name, req.parallel_tool_calls, params.stop)
        if held is not None:
            params = params.copy(logits_processors=[*params.logits_processors, held])
        await self.limiter.acquire()
        trace.stamp("slot")
        try:
            lease = await self.sessions.start(instructions, history, added, params, tools=req.tools, keep=keep,
                                              schema=req.schema, strict_tools=req.strict_tools, adapter=model.adapter)
            lease.model = model.id
            lease.keep_when_stopped()
            opened = _OPENED.get()
            if opened is not None:
                opened.append(lease)
            return lease
        except BaseException:
            self.limiter.release()
            raise

    @contextlib.asynccontextmanager
    async def settled(self, lease: Lease) -> AsyncIterator[None]:
        """Close the turn however the block ends (a client gone mid-stream cancels it): the reply so
        far commits, the conversation is re-indexed, the slot freed, the turn's figures recorded
        (``metrics.observe_turn``): every API's handler that settles its turns here is measured."""
        try:
            yield
        finally:
            if not lease.settled:  # once (a response whose body never ran is settled by the endpoint)
                lease.settled = True
                with anyio.CancelScope(shield=True):
                    try:
                        await lease.stream.aclose()
                        await self.sessions.finish(lease)
                    finally:
                        self.limiter.release()
                        self.metrics.observe_turn(lease.stream.stats)
                        trace.turn(lease.stream.stats)
                        trace.stamp("settled")

    @contextlib.contextmanager
    def leases(self) -> Iterator[list[Lease]]:
        """The turns a request's handler opens (``open_turn``) are listed here, so that :meth:`settle_all`
        can settle those it left open: it failed after opening one, or its stream was never read (a client
        gone before the body started)."""
        opened: list[Lease] = []
        token = _OPENED.set(opened)
        try:
            yield opened
        finally:
            _OPENED.reset(token)

    async def settle_all(self, leases: Sequence[Lease]) -> None:
        """Settle every turn of ``leases`` not settled yet (nothing generated: nothing commits)."""
        for lease in leases:
            if not lease.settled:
                async with self.settled(lease):
                    pass


_OPENED: contextvars.ContextVar[list[Lease] | None] = contextvars.ContextVar("chatkit_opened_turns", default=None)
Handler = Callable[[ServerState, Request], Awaitable[Response]]  # an endpoint of the app, given the state


def reply_of(lease: Lease) -> ChatMessage:
    """The reply the turn committed (what a client re-sends to go on), or what streamed if it did not."""
    return lease.reply() or ChatMessage.assistant(lease.stream.text)


def _no_tool_calls(tokenizer: Any) -> dict[int, float]:
    """A logit bias that keeps the model from starting a tool call (``tool_choice="none"``): its
    tool-call start markers (in the format of the turn's adapter, if it records one), when each is one
    token; ``BadRequestError`` when one is not."""
    markers = {marker for edges in segments.transitions(tokenizer).values() for marker, dst in edges if dst == "tool"}
    bias = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            raise BadRequestError(
                f"tool_choice 'none': this model starts a tool call with {marker!r}, which is not one token, so "
                "chatkit cannot keep it from calling; leave the tools out of this request instead.", param="tool_choice")
        bias[ids[0]] = -1e9
    return bias


__all__ = ["Handler", "Limiter", "ServerConfig", "ServerState", "reply_of"]
