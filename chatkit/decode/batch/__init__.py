"""``BatchEngine``: many sessions' turns decoded together, one forward pass per step over all of them.

One scheduler thread owns the model (``engine.py``). Continuous batching: turns join and leave
between steps. A new turn's prompt is prefilled into the session's own cache, in chunks of the
session's ``prefill_step_size`` (at most the engine's per step, between the others' decode steps);
its last token is fed on that cache too, and the cache then joins the batch's rows (``rows.py``,
mlx-lm's ``BatchKVCache``): it is copied there once and the session lets go of it, so that while the
turn runs the batch holds the only copy. Tokens come back through a queue on the turn's own thread
(``source.py``). When the turn ends, its row's cache goes back to the session, trimmed to what the
turn fed and read (after a failure, or when the engine is closed, to its prompt: the turn commits no
reply and the next one reuses the prompt), so commit, reuse, undo and save work exactly as for a
session alone. Each session's sampler and processors are guarded: one that raises fails its own turn.

What runs alone (through the session's local source, as without an engine), and why:
- speculative sessions (the step loop feeds one token per row; the verifying step, ``Rows.verify``,
  is not wired to sessions yet);
- sessions with an adapter (``builder.adapter``): one forward pass applies one set of layers to every
  row, and the engine's rows are the base model's; an adapted turn decodes alone, on its own thread,
  with its adapter (``model/switchable.py``), next to the engine's batch of base-model turns;
- caches that are not plain ``KVCache`` layers (``max_kv_size`` / sliding-window, hybrid models, quantized
  KV): the engine runs ahead of a turn's reader and must trim the cache back to what was read, which
  rotating and recurrent layers cannot do; mlx-lm has no batched quantized cache.
"""

from .engine import BatchEngine, check_engine
from .source import BatchSource, batchable

__all__ = ["BatchEngine", "BatchSource", "batchable", "check_engine"]
