"""Stored responses (``POST /v1/responses`` with ``store``), by id, each with what it added to its
conversation, so that ``previous_response_id`` chains on it; with a folder (``--store``), one JSON
file per response that outlives the process.

A response is written only if it reads back: its JSON is made first (strict JSON: no ``NaN``, text
UTF-8 can hold), then written atomically (a locked temporary file, fsync, rename), so a stored
response never answers a ``GET`` with a 500. At start the temporary files of killed writes are
removed and a file that does not read back (damaged, or written by an older version) is skipped
with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from ..cache import atomic
from ..errors import ChatKitError
from ..messages import ChatMessage, Role, saved_dict
from .errors import UnknownResponseError

log = logging.getLogger("chatkit.server")
Run = Callable[..., Awaitable[Any]]  # ``run(fn, *args)``: ``fn(*args)`` off the event loop


class ResponseStore:
    """Responses by id, each with the messages it added to its conversation and its reply; kept in
    ``folder`` when given (``None``: in memory only)."""

    def __init__(self, folder: str | os.PathLike[str] | None, run: Run | None = None) -> None:
        """``run``: how a file is written off the event loop (the server's one worker, ``SessionIndex.run``;
        by default a thread of anyio's)."""
        self._folder = Path(folder) if folder is not None else None
        self._run: Run = run if run is not None else anyio.to_thread.run_sync
        self._responses: dict[str, dict[str, Any]] = {}
        self._messages: dict[str, tuple[ChatMessage, ...]] = {}  # what each added, its reply last
        if self._folder is not None:
            self._open(self._folder)

    def add(self, response: dict[str, Any], added: Sequence[ChatMessage], reply: ChatMessage) -> None:
        """Keep ``response`` (an OpenAI response object) with the messages it added and its reply.
        ``ChatKitError`` (and nothing kept) if it cannot be written so that it reads back."""
        rid, data = _encoded(response, added, reply)
        if self._folder is not None:
            write_file(self._folder / f"{rid}.json", f"response {rid}", data)
        self._responses[rid], self._messages[rid] = response, (*added, reply)

    async def add_async(self, response: dict[str, Any], added: Sequence[ChatMessage], reply: ChatMessage) -> None:
        """:meth:`add` on the event loop: the file is written (and synced) off it meanwhile (``run``), and the
        response is kept once it is."""
        rid, data = _encoded(response, added, reply)
        if self._folder is not None:
            await self._run(write_file, self._folder / f"{rid}.json", f"response {rid}", data)
        self._responses[rid], self._messages[rid] = response, (*added, reply)

    def get(self, rid: str) -> dict[str, Any]:
        """The stored response object; ``UnknownResponseError`` if there is none with that id."""
        self._check(rid)
        return self._responses[rid]

    def delete(self, rid: str) -> None:
        """Forget response ``rid`` for good (its file removed, the removal synced): responses that
        chain on it stay, listed and opened from the response after it (``conversations``, ``turns``),
        but ``previous_response_id`` through it no longer resolves (404). ``UnknownResponseError`` if
        there is none; ``ChatKitError`` (and it is still stored) if its file cannot be removed."""
        self._check(rid)
        if self._folder is not None:
            try:
                (self._folder / f"{rid}.json").unlink(missing_ok=True)
                atomic.sync_folder(self._folder)
            except OSError as exc:
                raise ChatKitError(f"Response {rid} cannot be deleted: {exc.strerror or exc}. It is still stored; "
                                   "try again later.") from None
        del self._responses[rid], self._messages[rid]

    def added(self, rid: str) -> tuple[ChatMessage, ...]:
        """The messages response ``rid`` was given after its previous response (its reply not included)."""
        self._check(rid)
        return self._messages[rid][:-1]

    def held_chain(self, rid: str) -> list[str]:
        """``rid`` and the responses before it, oldest first, back to the first that is not held
        (deleted) or the start of the conversation."""
        chain = [rid]
        previous = self.get(rid).get("previous_response_id")
        while previous in self._responses and previous not in chain:
            chain.append(previous)
            previous = self._responses[previous].get("previous_response_id")
        return chain[::-1]

    def __len__(self) -> int:
        return len(self._responses)

    def transcript(self, rid: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including response ``rid``'s reply."""
        chain: list[str] = []
        current: str | None = rid
        while current is not None:
            self._check(current)
            chain.append(current)
            current = self._responses[current].get("previous_response_id")
            if len(chain) > len(self._responses):
                raise UnknownResponseError("The stored responses form a loop: start a new conversation.")
        return tuple(m for r in reversed(chain) for m in self._messages[r])

    def conversations(self) -> list[dict[str, Any]]:
        """The stored conversations, newest first: the responses that share a first response are one
        conversation (regenerated and edited turns are its branches), its head the newest of them."""
        roots: dict[str, str] = {}  # response id -> the first response of its chain
        depth: dict[str, int] = {}
        heads: dict[str, str] = {}  # first response -> the newest response under it
        for rid in self._responses:  # oldest first
            chain: list[str] = []
            current: str | None = rid
            while current is not None and current not in roots and current in self._responses:
                if len(chain) > len(self._responses):
                    break  # a loop of damaged files: left out
                chain.append(current)
                current = self._responses[current].get("previous_response_id")
            if current is not None and current not in roots:
                if current in self._responses:
                    continue  # a loop of damaged files: left out
                current = None  # the response before was deleted: the conversation is listed from here on
            top, base = (roots[current], depth[current]) if current is not None else (chain[-1], 0)
            for i, r in enumerate(reversed(chain)):
                roots[r], depth[r] = top, base + i + 1
            heads.pop(top, None)
            heads[top] = rid
        return [{"object": "conversation", "id": top, "head": head, "title": self._title(top),
                 "updated_at": self._responses[head]["created_at"], "turns": depth[head]}
                for top, head in reversed(heads.items())]

    def turns(self, rid: str) -> list[tuple[dict[str, Any], tuple[ChatMessage, ...]]]:
        """Each response of the chain ending at ``rid``, first to last, with the messages its input added:
        back to the first response or to one deleted (the first turn's ``previous_response_id`` then names
        a response no longer held: a gap)."""
        self._check(rid)
        chain = self.held_chain(rid)
        if self._responses[chain[0]].get("previous_response_id") in chain:
            raise UnknownResponseError("The stored responses form a loop: start a new conversation.")
        return [(self._responses[r], self._messages[r][:-1]) for r in chain]

    def _title(self, rid: str) -> str:
        users = [m.content for m in self._messages[rid] if m.role is Role.USER]
        return " ".join((users[0] if users else "").split())[:80]

    def _check(self, rid: str) -> None:
        if rid not in self._responses:
            raise UnknownResponseError(
                f"No stored response {rid!r}: it was never stored (store=false), was deleted, or belongs to another "
                "server; "
                "send the conversation again without previous_response_id."
            )

    def _open(self, folder: Path) -> None:
        """Create ``folder`` if needed, remove what killed writes left, read every response that reads back."""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if not folder.is_dir():
                raise NotADirectoryError(f"{str(folder)!r} is a file")
            legacy = list(folder.glob("resp_*.tmp"))  # the temporary files of older versions' writes
        except OSError as exc:
            raise ChatKitError(f"The response store {str(folder)!r} cannot be used: {exc.strerror or exc}. "
                               "Give --store a folder chatkit can create and write.") from exc
        atomic.remove_stale_temps(folder)
        for path in legacy:
            path.unlink(missing_ok=True)
        for path in sorted(folder.glob("resp_*.json"), key=_written):  # oldest first, as they were added
            try:
                self._load(path)
            except (OSError, ValueError, KeyError, TypeError, RecursionError, ChatKitError) as exc:
                log.warning("ignoring the unreadable stored response %s: %s", path.name, exc)

    def _load(self, path: Path) -> None:
        if not path.is_file():  # a FIFO would block the server's start forever
            raise ValueError("not a regular file")
        record = json.loads(path.read_text(encoding="utf-8"))
        response, rid = record["response"], record["response"]["id"]
        if rid != path.stem or not isinstance(record["added"], list):
            raise ValueError("not a response this store wrote")
        json.dumps(response, ensure_ascii=False, allow_nan=False).encode("utf-8")  # sent back as it is
        messages = [ChatMessage.from_dict(m) for m in (*record["added"], record["reply"])]
        self._responses[rid], self._messages[rid] = response, tuple(messages)


def _encoded(response: dict[str, Any], added: Sequence[ChatMessage], reply: ChatMessage) -> tuple[str, bytes]:
    """(id, the file's bytes) of a response to store; ``ChatKitError`` if it does not make JSON that reads back."""
    rid = response["id"]
    record = {"response": response, "added": [saved_dict(m, pixels=True) for m in added], "reply": saved_dict(reply)}
    try:
        return rid, json.dumps(record, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:  # UnicodeEncodeError is a ValueError
        raise ChatKitError(f"Response {rid} cannot be stored: it does not make JSON that reads back ({exc}). "
                           "Nothing was stored; send the request again without the offending value.") from None


def _written(path: Path) -> tuple[int, str]:
    try:
        return path.stat().st_mtime_ns, path.name
    except OSError:  # gone meanwhile: reading it fails and says so
        return 0, path.name


def write_file(path: Path, what: str, data: bytes) -> None:
    """``path`` holds ``data``, written atomically (``CacheFileError`` saying what went wrong)."""
    def write_to(tmp: str) -> None:
        Path(tmp).write_bytes(data)

    atomic.write(path, what, write_to)


__all__ = ["ResponseStore", "write_file"]
