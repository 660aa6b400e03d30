"""The public surface is exactly what chatkit.__all__ names (as httpx pins its own): adding or removing a
public name is a decision, made here."""

import chatkit

PUBLIC = {
    # loading and sessions
    "load", "LoadedModel", "ChatSession", "ChatSessionBuilder", "SessionPool", "BatchEngine",
    # streaming
    "ResponseStream", "ToolLoopStream", "AsyncResponseStream", "StreamChunk", "TurnStats",
    # messages and settings
    "ChatMessage", "Role", "ToolCall", "GenerateParams", "CacheOptions", "CacheInfo", "SpeculativeConfig",
    "ContextPolicy",  # conversations that outlive the context window
    "SessionConfig",  # a session's settings, one frozen value (session.config)
    "load_adapter", "Adapter",  # LoRA/DoRA adapters per session (docs/adapters.md)
    "MCPServer", "MCPServerError",  # tools from MCP servers (docs/tools.md)
    # persistence
    "inspect_cache", "CacheFileInfo",
    "PromptCache", "PromptCacheUsage",  # KV blocks shared by every session, in RAM and on disk (docs/caching.md)
    # errors
    "ChatKitError", "ModelLoadError", "TemplateError", "InvalidMessageError", "InvalidParamsError",
    "SpeculativeCacheRestoreError", "IncompatibleDraftError", "MissingDependencyError", "SessionBusyError", "ContextWindowExceededError",
    "SummaryError", "NothingToUndoError", "NothingToRegenerateError", "CacheError", "NoCacheAvailableError", "CacheFileError",
    "IncompatibleCacheError", "ToolLoopLimitError", "ToolExecutionError", "DistributedError",
    "InvalidOutputSpecError", "OutputValidationError", "IncompleteOutputError",  # guided replies (respond(output=...))
}


def test_all_is_the_public_surface():
    assert set(chatkit.__all__) == PUBLIC
    assert len(chatkit.__all__) == len(PUBLIC)


def test_every_public_name_is_chatkits_own_and_documented():
    for name in chatkit.__all__:
        member = getattr(chatkit, name)
        assert member.__module__.startswith("chatkit."), name
        assert member.__doc__ and member.__doc__.strip(), f"{name} has no docstring"


def test_errors_form_one_tree():
    for name in chatkit.__all__:
        member = getattr(chatkit, name)
        if isinstance(member, type) and issubclass(member, Exception):
            assert issubclass(member, chatkit.ChatKitError), name
    for name in ("NoCacheAvailableError", "CacheFileError", "IncompatibleCacheError"):
        assert issubclass(getattr(chatkit, name), chatkit.CacheError)
    assert issubclass(chatkit.SpeculativeCacheRestoreError, chatkit.InvalidParamsError)
    assert not issubclass(chatkit.NothingToRegenerateError, chatkit.NothingToUndoError)
    tree = chatkit.errors.__doc__
    assert all(name in tree for name in PUBLIC if name.endswith("Error"))


def test_the_module_docstring_maps_the_api():
    doc = chatkit.__doc__
    for name in ("load", "ChatSession", "ResponseStream", "GenerateParams", "SessionPool", "ChatKitError"):
        assert name in doc
