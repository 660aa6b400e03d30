"""The session layer: a conversation over time. ``ChatSession`` and its builder, the turn pipeline
(render -> plan -> prefill -> stream -> commit), streams, async streams, the tool loop, the pool and
the saved conversation.

Knows nothing of HTTP or terminals.
"""
