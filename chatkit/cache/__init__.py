"""KV cache reuse: the ledger of cached token ids, reuse planning, and the cache state of a session."""

from .ledger import Ledger
from .planner import Action, Plan, common_prefix_length, plan
from .state import CacheOptions, CacheState

__all__ = ["Action", "CacheOptions", "CacheState", "Ledger", "Plan", "common_prefix_length", "plan"]
