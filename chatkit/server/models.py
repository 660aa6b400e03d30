"""The models a server answers for: the model it was started with and, for each of its adapters
(``ServerConfig.adapters``, ``chatkit serve --adapter NAME=PATH``), ``<id>:<NAME>``: what ``/v1/models``
lists and what a request's ``model`` field selects (``ServedModels.select``).

A ``model`` that is not one of them (absent, or another name such as ``gpt-4o``) selects the base model,
as it always has: clients must send some model. Only ``<id>:<NAME>`` with a ``NAME`` the server has no
adapter for is refused (404 ``model_not_found``), before any work. A stored response's chain keeps the
model it started with (``ServedModels.chained``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidParamsError
from ..model.adapters import Adapter, check_adapter
from ..model.loaded import LoadedModel
from .errors import BadRequestError, UnknownModelError

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z")


@dataclass(frozen=True)
class Selection:
    """The model a request runs on: ``id`` as replies show it, ``adapter`` its adapter's name (``None``:
    the base model); ``named``: the request named a served model (else it got the base by default)."""

    id: str
    adapter: str | None = None
    named: bool = False


def check_adapter_name(name: object) -> str:
    """``name`` if it can name an adapter (``<id>:<name>``); ``InvalidParamsError`` otherwise."""
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise InvalidParamsError(
            f"Adapter name {name!r}: use 1 to 64 letters, digits, '.', '_' or '-' (starting with a letter or "
            "digit); clients select it as model '<model id>:<name>'.")
    return name


class ServedModels:
    """The served model ``model_id`` over ``lm`` and its adapters by name (an ``Adapter``, or the path
    of an adapter folder, read now). ``ModelLoadError`` for an adapter that does not fit ``lm``,
    ``InvalidParamsError`` for a bad name: a server with a bad adapter does not start."""

    def __init__(self, lm: LoadedModel, model_id: str,
                 adapters: Mapping[str, Adapter | str | os.PathLike[str]] | None = None) -> None:
        self.base = model_id
        self.adapters: dict[str, Adapter] = {}
        for name, adapter in (adapters or {}).items():
            check_adapter_name(name)
            if isinstance(adapter, Adapter):
                check_adapter(adapter, lm)
            else:
                adapter = lm.adapter(adapter)
            self.adapters[name] = adapter

    def id_of(self, adapter: str | None) -> str:
        """The model id that selects ``adapter`` (``None``: the base model's)."""
        return self.base if adapter is None else f"{self.base}:{adapter}"

    def listing(self, created: int) -> list[dict[str, Any]]:
        """The served models as OpenAI model objects, the base model first."""
        base = {"id": self.base, "object": "model", "created": created, "owned_by": "chatkit"}
        return [base, *({"id": self.id_of(name), "object": "model", "created": created, "owned_by": "chatkit",
                         "parent": self.base} for name in self.adapters)]

    def select(self, model: str | None) -> Selection:
        """What a request's ``model`` selects (see the module docstring)."""
        if model == self.base:
            return Selection(self.base, None, True)
        name = self._adapter_in(model)
        if name is None:
            return Selection(self.base)
        if name not in self.adapters:
            raise UnknownModelError(f"The model {model!r} does not exist: this server has no adapter {name!r}. "
                                    f"GET /v1/models lists the models it serves.")
        return Selection(self.id_of(name), name, True)

    def chained(self, model: str | None, previous: str) -> Selection:
        """The model of a response that continues one answered by ``previous`` (its ``model``): that one,
        a chain keeps its adapter. A request that names another served model is a 400; a chain whose
        adapter this server no longer has, a 404."""
        held = self._adapter_in(previous)
        if held is not None and held not in self.adapters:
            raise UnknownModelError(
                f"The conversation previous_response_id continues was answered by {previous!r}, which this server "
                "no longer serves (GET /v1/models lists those it does): start a new conversation without "
                "previous_response_id.")
        asked = self.select(model)
        if asked.named and asked.adapter != held:
            raise BadRequestError(
                f"model {model!r}: the conversation previous_response_id continues was answered by "
                f"{self.id_of(held)!r}, and a conversation keeps its model: send model {self.id_of(held)!r}, or "
                "start a new conversation (without previous_response_id) with this one.", param="model")
        return Selection(self.id_of(held), held, asked.named)

    def _adapter_in(self, model: str | None) -> str | None:
        """The adapter name in ``<id>:<name>`` (``None`` for any other model string)."""
        prefix = self.base + ":"
        if isinstance(model, str) and model.startswith(prefix):
            return model[len(prefix):]
        return None


__all__ = ["ADAPTER_NAME", "Selection", "ServedModels", "check_adapter_name"]
