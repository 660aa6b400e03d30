"""``SessionConfig``: a session's settings as one frozen value (invariant 12).

The builder makes one, ``ChatSession(lm, config)`` checks it, ``session.config`` returns it, ``fork()``
copies it and a saved conversation keeps what of it is data. The conversation itself (history, cache,
window) is state, not configuration, and is not in it. A turn's own options (``params=``,
``logits_processors=``) never change it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..cache.prompt import PromptCache, default_prompt_cache
from ..cache.state import CacheOptions
from ..decode import ProgressCallback
from ..decode.batch import BatchEngine, check_engine
from ..decode.speculative import SpeculativeConfig, check_cache_options
from ..errors import InvalidParamsError
from ..messages import check_instructions
from ..model.adapters import Adapter
from ..model.loaded import LoadedModel
from ..model.switchable import ActiveAdapter, activate
from ..params import GenerateParams
from ..tools import as_tools
from ..tools.options import ToolOptions
from .context import ContextPolicy


@dataclass(frozen=True)
class SessionConfig:
    """A session's settings (``session.config``); change one with ``dataclasses.replace`` and build a session
    from it (``ChatSession(lm, config)`` or ``builder.config(config)``).

    ``instructions``: the system prompt; ``generate_params``: the sampling settings of every turn that
    gives none of its own; ``chat_template``: a jinja template instead of the tokenizer's;
    ``tools`` / ``tool_options``: the tools and how they run (``builder.tools``); ``cache_options``: how
    the KV cache is built; ``context_policy``: what a turn does when the conversation outgrows the window;
    ``speculative``: draft decoding; ``engine``: a shared ``BatchEngine``; ``adapter``: a LoRA adapter and
    its scale; ``prompt_cache``: ``"default"`` (the model's), a ``PromptCache`` or ``None``; ``max_kv_bytes``:
    a KV budget; ``allow_special_in_content``: read special-token strings in content as tokens;
    ``prefill_progress``: ``callback(done, total)`` while a prompt is prefilled.
    """

    instructions: str | None = None
    generate_params: GenerateParams = field(default_factory=GenerateParams)
    chat_template: str | None = None
    tools: Sequence[Any] | None = None
    tool_options: ToolOptions = ToolOptions()
    cache_options: CacheOptions = CacheOptions()
    context_policy: ContextPolicy = ContextPolicy()
    speculative: SpeculativeConfig | None = None
    engine: BatchEngine | None = None
    adapter: ActiveAdapter | None = None
    prompt_cache: PromptCache | None | str = "default"
    max_kv_bytes: int | None = None
    allow_special_in_content: bool = False
    prefill_progress: ProgressCallback | None = None

    @classmethod
    def of(cls, config: SessionConfig | None, settings: Mapping[str, Any]) -> SessionConfig:
        """``config`` (default: the defaults) with ``settings`` (field names) over it; ``InvalidParamsError``
        for anything else."""
        if config is not None and not isinstance(config, SessionConfig):
            raise InvalidParamsError(f"A session's config is a chatkit.SessionConfig, got {type(config).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise InvalidParamsError(f"Unknown session setting(s) {unknown}: use {sorted(known)}.")
        if settings.get("generate_params", 0) is None:  # the old keyword's "default"
            settings = {**settings, "generate_params": GenerateParams()}
        return replace(config or cls(), **settings)

    def checked(self, lm: LoadedModel) -> SessionConfig:
        """This configuration checked against ``lm`` (``InvalidParamsError`` naming what is wrong), with its
        tools as ``chatkit.tools.Tool`` s, its adapter active and its prompt cache resolved."""
        if not isinstance(self.generate_params, GenerateParams):
            raise InvalidParamsError(f"generate_params must be a GenerateParams, got {type(self.generate_params).__name__}.")
        check_engine(self.engine, lm.model)
        if not isinstance(self.cache_options, CacheOptions):
            raise InvalidParamsError(f"cache_options must be a CacheOptions, got {type(self.cache_options).__name__}.")
        self.cache_options.validate(lm.head_dim)
        check_cache_options(self.speculative, self.cache_options)
        if not isinstance(self.context_policy, ContextPolicy):
            raise InvalidParamsError(f"context_policy takes a chatkit.ContextPolicy, got {type(self.context_policy).__name__}.")
        if not isinstance(self.tool_options, ToolOptions):
            raise InvalidParamsError(f"tool_options takes a chatkit.tools.ToolOptions, got {type(self.tool_options).__name__}.")
        self.tool_options.validate()
        if not isinstance(self.allow_special_in_content, bool):
            raise InvalidParamsError(f"allow_special_in_content takes a bool, got {self.allow_special_in_content!r}.")
        if self.prefill_progress is not None and not callable(self.prefill_progress):
            raise InvalidParamsError("prefill_progress takes a callable (done, total) or None.")
        tools = as_tools(self.tools)
        return replace(
            self, instructions=check_instructions(self.instructions), context_policy=self.context_policy.checked(),
            tools=None if tools is None else tuple(tools), adapter=_active(lm, self.adapter),
            prompt_cache=_prompt_cache(lm, self.prompt_cache),
        )


def _active(lm: LoadedModel, adapter: ActiveAdapter | Adapter | None) -> ActiveAdapter | None:
    if adapter is None or isinstance(adapter, ActiveAdapter):
        return adapter
    if isinstance(adapter, Adapter):
        return activate(lm, adapter)
    raise InvalidParamsError("adapter: use builder.adapter(adapter, scale) or session.adapter = adapter.")


def _prompt_cache(lm: LoadedModel, chosen: PromptCache | None | str) -> PromptCache | None:
    """The session's prompt cache: ``"default"`` is the model's process-wide one; none for a model sharded
    over processes (every rank must take the same decisions, and each rank's cache could differ)."""
    sharded = lm.distributed is not None and lm.distributed.sharded
    if chosen == "default":
        return None if sharded else default_prompt_cache(lm)
    if chosen is not None and not isinstance(chosen, PromptCache):
        raise InvalidParamsError(f"prompt_cache takes a chatkit.PromptCache or None, got {type(chosen).__name__}.")
    if chosen is not None and sharded:
        raise InvalidParamsError("A model sharded over processes cannot use a prompt cache (its ranks must prefill "
                                 "alike): drop prompt_cache(...) or give None.")
    return chosen


__all__ = ["SessionConfig"]
