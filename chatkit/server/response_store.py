"""Stored responses, by id, each with what it added to its conversation, so that a request naming one
as its ``previous_response_id`` goes on from the whole conversation; one JSON file each with ``--store``."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..messages import ChatMessage, saved_dict
from .errors import UnknownResponseError

log = logging.getLogger("chatkit.server")


class ResponseStore:
    """Responses by id, each with what it added to its conversation; one JSON file per response in
    ``folder`` (written atomically) when given, so chains outlive the server."""

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        self._folder = Path(folder) if folder is not None else None
        self._records: dict[str, dict[str, Any]] = {}
        if self._folder is not None:
            self._folder.mkdir(parents=True, exist_ok=True)
            for path in self._folder.glob("resp_*.json"):
                try:
                    record = json.loads(path.read_text())
                    self._records[record["response"]["id"]] = record
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring the unreadable stored response %s: %s", path.name, exc)

    def add(self, response: dict[str, Any], added: Sequence[ChatMessage], reply: ChatMessage) -> None:
        """Keep ``response`` (an OpenAI response object) with the messages it added and its reply."""
        record = {"response": response, "added": [saved_dict(m) for m in added], "reply": saved_dict(reply)}
        self._records[response["id"]] = record
        if self._folder is not None:
            path = self._folder / f"{response['id']}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, ensure_ascii=False))
            os.replace(tmp, path)

    def get(self, rid: str) -> dict[str, Any]:
        """The stored response object; ``UnknownResponseError`` if there is none with that id."""
        return self._record(rid)["response"]

    def transcript(self, rid: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including response ``rid``'s reply."""
        chain = []
        while rid is not None:
            record = self._record(rid)
            chain.append(record)
            rid = record["response"].get("previous_response_id")
            if len(chain) > len(self._records):
                raise UnknownResponseError("The stored responses form a loop: start a new conversation.")
        messages: list[ChatMessage] = []
        for record in reversed(chain):
            messages += [ChatMessage.from_dict(m) for m in record["added"]]
            reply = record.get("reply")
            messages.append(ChatMessage.from_dict(reply) if reply else ChatMessage.assistant(record["output"]))
        return tuple(messages)

    def _record(self, rid: str) -> dict[str, Any]:
        record = self._records.get(rid)
        if record is None:
            raise UnknownResponseError(
                f"No stored response {rid!r}: it was never stored (store=false) or belongs to another server; "
                "send the conversation again without previous_response_id."
            )
        return record


__all__ = ["ResponseStore"]
