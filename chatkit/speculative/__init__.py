"""Draft-model speculative decoding: the configuration and the draft's compatibility checks."""

from .config import SpeculativeConfig, check_cache_options, check_draft

__all__ = ["SpeculativeConfig", "check_cache_options", "check_draft"]
