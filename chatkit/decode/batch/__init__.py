"""``BatchEngine``: many sessions' turns decoded together, one forward pass per step over all of them.

One scheduler thread owns the model (``engine.py``). Continuous batching: turns join and leave
between steps. New turns' prompts are prefilled together (``prefill.py``: up to 8 turns, one
right-padded forward pass per chunk of at most the sessions' ``prefill_step_size`` and the engine's
per step, between the others' decode steps); their caches are copied once into the prefill's batched
layers (the sessions let go of them), then into the batch's rows (``rows.py``, mlx-lm's
``BatchKVCache``), whose next step feeds the prompts' last tokens with the other rows' tokens: while
a turn runs, the engine holds the only copy of its cache. Tokens come back through a queue on the turn's own thread
(``source.py``). When the turn ends, its row's cache (and its draft cache) goes back to the session, trimmed to what the
turn fed and read (after a failure, or when the engine is closed, to its prompt: the turn commits no
reply and the next one reuses the prompt), so commit, reuse, undo and save work exactly as for a
session alone. Each session's sampler and processors are guarded: one that raises fails its own turn.

Speculative sessions run inside the batch. Prompt lookup (``SpeculativeConfig("prompt_lookup")``):
each such row's n-gram index proposes drafts. A draft model (``SpeculativeConfig(draft_lm)``): the rows
sharing a draft model draft together (``drafts.py``: one batched draft cache per draft model, the rows'
draft caches moved in as they join and handed back as they leave, like the target's), one draft pass
per step and draft model, after catching up what each row's draft has not seen (plain steps, the
prompt: the draft prefills nothing until its row first drafts). Each row drafts when its draft-length
policy says (the session's own, fed with the batch's step times), and a step where any row drafted
verifies every row's drafts in one forward pass (``rows.py``), as wide as the longest draft asked for;
every row that can draft drafts up to that width (a lookup row always, a draft model's rows when one
of them asks); rows without drafts take a normal step within it. Each row keeps its drafts up to the
first rejected one and drops the rest from its target cache and its draft cache: after every step a
draft cache holds only accepted tokens, and after a turn the session's draft cache holds a prefix of
what its target cache holds (invariant 1). Greedy tokens are those of the session alone.

Why chatkit's own step loop over mlx-lm's ``BatchKVCache`` and not mlx-lm's ``BatchGenerator``: it
feeds one token per row and step (verifying drafts needs several positions per row in one pass and a
per-row trim), it copies the whole batch's cache as rows join and leave (two copies of every cache at
the peak), and it takes one ``prefill_step_size`` for every request. Its batched prefill of joining
turns is kept (``prefill.py``).

What runs alone (through the session's local source, as without an engine), and why:
- sessions with an adapter (``builder.adapter``): one forward pass applies one set of layers to every
  row, and the engine's rows are the base model's; an adapted turn decodes alone, on its own thread,
  with its adapter (``model/switchable.py``), next to the engine's batch of base-model turns;
- turns with images to feed (``Request.vision``): their embeddings and M-RoPE positions are the turn's
  own, which one batched forward pass over the rows' token ids cannot take;
- caches that are not plain ``KVCache`` layers (``max_kv_size`` / sliding-window, hybrid models, quantized
  KV): the engine runs ahead of a turn's reader and must trim the cache back to what was read, which
  rotating and recurrent layers cannot do; mlx-lm has no batched quantized cache.
"""

from .engine import BatchEngine, check_engine
from .source import BatchSource, batchable

__all__ = ["BatchEngine", "BatchSource", "batchable", "check_engine"]
