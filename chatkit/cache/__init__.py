"""KV cache internals: the ledger of cached ids (``ledger``), reuse planning (``planner``), a session's
cache state (``state``), the file format (``store``) and every contact with mlx-lm's cache classes
(``_mlx``). The public names (``CacheOptions``, ``CacheInfo``, ``CacheFileInfo``) are ``chatkit``'s."""
