"""The HTTP face: a Starlette app serving OpenAI's chat completions, responses and models endpoints
over chatkit's pooled sessions (``SessionIndex``)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..decode.batch import BatchEngine
from ..decode.speculative import SpeculativeConfig
from ..errors import ChatKitError
from ..messages import ChatMessage
from ..model.loaded import LoadedModel
from ..params import GenerateParams
from ..text import reply as segments
from . import protocol as wire
from .errors import BadRequestError, OverloadedError, UnauthorizedError, error_body
from .session_index import Lease, ResponseStore, SessionIndex

log = logging.getLogger("chatkit.server")


@dataclass
class ServerConfig:
    """How ``chatkit serve`` runs. ``store``: a folder where conversations and responses outlive the
    process (``None``: a temporary folder, forgotten at exit). ``parallel`` turns generate at once (with
    ``batch``, decoded together by one ``chatkit.BatchEngine``: one forward pass per step for all of
    them, more throughput for many clients, some latency for one) and ``queue`` more may wait;
    beyond that, 503. ``api_key``: require ``Authorization: Bearer KEY``."""

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


def create_app(lm: LoadedModel, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving ``lm``; run it with uvicorn (``chatkit serve``) or :func:`chatkit.server.start`."""
    config = config or ServerConfig()
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
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
            state["conversations"] = convs = SessionIndex(
                lm, folder=root, max_cache_bytes=config.max_cache_bytes, max_conversations=config.max_conversations,
                defaults=config.defaults, speculative=config.speculative, persist=config.store is not None,
                engine=engine,
            )
            state["responses"] = ResponseStore(root / "responses" if config.store is not None else None)
            state["limiter"] = Limiter(config.parallel, config.queue)
            try:
                yield
            finally:
                await convs.close()

    def endpoint(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            try:
                _authorize(request, config.api_key)
                return await handler(request)
            except Exception as exc:
                return _error(exc)
        return wrapped

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": config.model_id, "object": "model", "created": int(time.time()), "owned_by": "chatkit"}]})

    async def chat_completions(request: Request) -> Response:
        req = wire.parse_chat(await _json(request), config.defaults)
        lease, release = await _open(req.instructions, req.history, req.added, req)
        cid = wire.new_id("chatcmpl")
        if not req.stream:
            async with _settled(lease, release):
                finish = None
                async for chunk in lease.stream:
                    finish = chunk.finish_reason
            return JSONResponse(wire.chat_completion(cid, config.model_id, _reply(lease), finish, lease.stream.stats))

        async def events() -> AsyncIterator[str]:
            async with _settled(lease, release):
                try:
                    yield _sse(wire.chat_chunk(cid, config.model_id, {"role": "assistant", "content": ""}))
                    finish, calls, deltas = None, 0, wire.Deltas()
                    async for chunk in lease.stream:
                        finish = chunk.finish_reason
                        for kind, value in deltas.feed(chunk):
                            if kind == "call":
                                delta = {"tool_calls": [wire.tool_call_object(value, calls)]}
                                calls += 1
                            else:
                                delta = {"reasoning_content" if kind == "reasoning" else "content": value}
                            yield _sse(wire.chat_chunk(cid, config.model_id, delta))
                    for kind, value in deltas.end():
                        delta = {"reasoning_content" if kind == "reasoning" else "content": value}
                        yield _sse(wire.chat_chunk(cid, config.model_id, delta))
                    reason = wire.FINISH.get(finish, "stop")
                    yield _sse(wire.chat_chunk(cid, config.model_id, {}, "tool_calls" if calls and reason == "stop" else reason))
                    if req.include_usage:
                        await lease.stream.aclose()
                        usage = wire.chat_usage(lease.stream.stats)
                        yield _sse(wire.chat_chunk(cid, config.model_id, {}, usage=usage))
                    yield "data: [DONE]\n\n"
                except Exception as exc:  # after the headers: the error goes into the stream
                    yield _sse(error_body(exc)[1])

        return StreamingResponse(events(), media_type="text/event-stream")

    async def responses(request: Request) -> Response:
        req = wire.parse_responses(await _json(request), config.defaults)
        store: ResponseStore = state["responses"]
        before = store.transcript(req.previous_response_id) if req.previous_response_id else ()
        linked = wire.link_tool_results([*before, *req.added], "input", offset=len(before))
        added = tuple(linked[len(before):])  # tool results named after their calls
        instructions, history, new = wire.split_conversation(req.instructions, linked)
        lease, release = await _open(instructions, history, new, req, keep=req.store)
        rid, created = wire.new_id("resp"), int(time.time())
        items = wire.OutputItems()

        def response(status: str, output: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
            stats = lease.stream.stats
            return wire.response_object(
                rid, config.model_id, created_at=created, status=status, output=output,
                previous_response_id=req.previous_response_id, store=req.store,
                usage=wire.responses_usage(stats) if stats is not None else None, echo=req.echo,
                incomplete=finish == "length",
            )

        def keep(finish: str | None, ended: str = "done") -> dict[str, Any]:
            """The response as stored; ``ended``: "done", or "cancelled" (the client went away) or
            "failed" (an error mid-stream), each stored as far as the turn got."""
            reply = _reply(lease)
            status = ended if ended != "done" else "incomplete" if finish == "length" else "completed"
            obj = response(status, items.of(reply, status != "completed"), finish)
            if req.store and lease.reply() is not None:  # committed
                store.add(obj, added, reply)
            return obj

        if not req.stream:
            async with _settled(lease, release):
                finish = None
                async for chunk in lease.stream:
                    finish = chunk.finish_reason
            return JSONResponse(keep(finish))

        async def events() -> AsyncIterator[str]:
            seq = iter(range(1 << 62))

            def event(kind: str, **data: Any) -> str:
                return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **data})}\n\n"

            kinds: list[str] = []  # the kind of each output item streamed so far, by output_index
            state: dict[str, Any] = {"open": None, "text": ""}  # the reasoning or message item being streamed

            def close_item() -> Iterator[str]:
                """The done events of the reasoning or message item being streamed, if any."""
                kind, text, index = state["open"], state["text"], len(kinds) - 1
                state["open"] = None
                if kind == "reasoning":
                    where = {"item_id": items.id("reasoning"), "output_index": index, "content_index": 0}
                    yield event("response.reasoning_text.done", **where, text=text)
                    yield event("response.output_item.done", output_index=index, item=items.reasoning(text))
                elif kind == "text":
                    where = {"item_id": items.id("message"), "output_index": index, "content_index": 0}
                    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
                    yield event("response.output_text.done", **where, text=text, logprobs=[])
                    yield event("response.content_part.done", **where, part=part)
                    yield event("response.output_item.done", output_index=index, item=items.message(text))

            def pieces(kind: str, value: Any) -> Iterator[str]:
                """The events of one piece of the reply (``wire.Deltas``)."""
                if kind != state["open"]:
                    yield from close_item()
                    index = len(kinds)
                    kinds.append(kind)
                    if kind == "call":
                        where = {"item_id": items.id(value.id), "output_index": index}
                        done = items.call(value)
                        yield event("response.output_item.added", output_index=index,
                                    item=items.call(value, "in_progress"))
                        yield event("response.function_call_arguments.delta", **where, delta=done["arguments"])
                        yield event("response.function_call_arguments.done", **where, arguments=done["arguments"],
                                    name=value.name)
                        yield event("response.output_item.done", output_index=index, item=done)
                        return
                    state.update(open=kind, text="")
                    if kind in kinds[:-1]:
                        items.renew("reasoning" if kind == "reasoning" else "message")
                    if kind == "reasoning":
                        item = {**items.reasoning("", "in_progress"), "content": []}
                        yield event("response.output_item.added", output_index=index, item=item)
                    else:
                        yield event("response.output_item.added", output_index=index,
                                    item=items.message("", "in_progress"))
                        yield event("response.content_part.added", item_id=items.id("message"), output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                state["text"] += value
                where = {"output_index": len(kinds) - 1, "content_index": 0, "delta": value}
                if kind == "reasoning":
                    yield event("response.reasoning_text.delta", item_id=items.id("reasoning"), **where)
                elif value:
                    yield event("response.output_text.delta", item_id=items.id("message"), **where, logprobs=[])

            finish, kept, ended = None, {}, "cancelled"  # until the stream ends or fails
            try:
                async with _settled(lease, release):
                    try:
                        yield event("response.created", response=response("in_progress", []))
                        yield event("response.in_progress", response=response("in_progress", []))
                        deltas = wire.Deltas()
                        async for chunk in lease.stream:
                            finish = chunk.finish_reason
                            for kind, value in deltas.feed(chunk):
                                for text in pieces(kind, value):
                                    yield text
                        for kind, value in deltas.end():
                            for text in pieces(kind, value):
                                yield text
                        ended = "done"
                    except Exception as exc:
                        ended = "failed"
                        yield event("error", **error_body(exc)[1]["error"])
                        return
            finally:  # also when the client went away: the turn committed as far as it got, so is stored
                kept.update(keep(finish, ended))
            if not any(k != "reasoning" for k in kinds):  # an empty answer still has its message item
                for text in pieces("text", ""):
                    yield text
            for text in close_item():
                yield text
            yield event("response.incomplete" if kept["status"] == "incomplete" else "response.completed",
                        response=kept)

        return StreamingResponse(events(), media_type="text/event-stream")

    async def get_response(request: Request) -> Response:
        return JSONResponse(state["responses"].get(request.path_params["rid"]))

    async def _open(instructions: str | None, history: tuple[ChatMessage, ...], added: tuple[ChatMessage, ...],
                    req: wire.TurnRequest, keep: bool = True) -> tuple[Lease, Callable[[], None]]:
        params = req.params
        if req.tools and req.tool_choice == "none":
            params = params.copy(logit_bias={**(params.logit_bias or {}), **_no_tool_calls(lm)})
        limiter: Limiter = state["limiter"]
        await limiter.acquire()
        try:
            lease = await state["conversations"].start(instructions, history, added, params, tools=req.tools,
                                                       keep=keep, schema=req.schema,
                                                       strict_tools=req.strict_tools)
        except BaseException:
            limiter.release()
            raise
        return lease, limiter.release

    @contextlib.asynccontextmanager
    async def _settled(lease: Lease, release: Callable[[], None]) -> AsyncIterator[None]:
        """Close the turn however the block ends (a client gone mid-stream cancels it): the reply so
        far commits, the conversation is re-indexed, the slot freed."""
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await lease.stream.aclose()
                    await state["conversations"].finish(lease)
                finally:
                    release()

    routes = []
    for prefix in ("/v1", ""):
        routes += [
            Route(f"{prefix}/models", endpoint(models), methods=["GET"]),
            Route(f"{prefix}/chat/completions", endpoint(chat_completions), methods=["POST"]),
            Route(f"{prefix}/responses", endpoint(responses), methods=["POST"]),
            Route(f"{prefix}/responses/{{rid}}", endpoint(get_response), methods=["GET"]),
        ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


def _reply(lease: Lease) -> ChatMessage:
    """The reply the turn committed (what a client re-sends to go on), or what streamed if it did not."""
    return lease.reply() or ChatMessage.assistant(lease.stream.text)


def _no_tool_calls(lm: LoadedModel) -> dict[int, float]:
    """A logit bias that keeps the model from starting a tool call (``tool_choice="none"``): its
    tool-call start markers, when each is one token; ``BadRequestError`` when one is not."""
    markers = {marker for edges in segments.transitions(lm.tokenizer).values() for marker, dst in edges if dst == "tool"}
    bias = {}
    for marker in markers:
        ids = lm.tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) != 1:
            raise BadRequestError(
                f"tool_choice 'none': this model starts a tool call with {marker!r}, which is not one token, so "
                "chatkit cannot keep it from calling; leave the tools out of this request instead.", param="tool_choice")
        bias[ids[0]] = -1e9
    return bias


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise UnauthorizedError("Missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "with the key the server was started with (--api-key).")


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as exc:
        raise BadRequestError(f"The request body is not valid JSON ({exc}).") from exc


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error(exc: Exception) -> JSONResponse:
    status, body = error_body(exc)
    if not isinstance(exc, ChatKitError):
        log.exception("unexpected error while serving a request", exc_info=exc)
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", "") or "error"
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": f"{detail}: {request.method} {request.url.path}", "type": kind,
                                   "param": None, "code": None}}, status_code=status)


__all__ = ["Limiter", "ServerConfig", "create_app"]
