"""Which token source decodes a session's turns: local (maybe speculative) or in lockstep over a sharded model."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidParamsError
from . import TokenSource
from .local import LocalSource
from .lockstep import DistributedSource


def source_for(model: Any, group: Any = None, speculative: Any = None) -> TokenSource:
    """The token source for ``model``: local (speculative with a ``SpeculativeConfig``), or in lockstep
    with the other ranks when ``group`` (a ``distributed.Group``) shards it over more than one."""
    if group is None or not group.sharded:
        return LocalSource(model, speculative)
    if speculative is not None:
        raise InvalidParamsError(
            "Speculative decoding is not available over a sharded model: drop .speculative(...) "
            "(or load the model without distributed=...)."
        )
    return DistributedSource(model, group)


__all__ = ["source_for"]
