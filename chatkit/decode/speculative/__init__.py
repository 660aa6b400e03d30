"""Speculative decoding: the configuration, the draft's checks, the draft-length policy, prompt lookup.

The loop itself (``loop.py``) and its drafters (``drafters.py``) are imported by the local token source.
"""

from .config import PROMPT_LOOKUP, SpeculativeConfig, check_cache_options, check_draft, vocab_limit
from .lookup import NgramIndex
from .policy import DraftPolicy, new_policy

__all__ = ["DraftPolicy", "NgramIndex", "PROMPT_LOOKUP", "SpeculativeConfig", "check_cache_options", "check_draft",
           "new_policy", "vocab_limit"]
