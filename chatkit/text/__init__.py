"""The text layer: messages (+ tools) to token ids through the model's chat template, and a reply's text
back to its answer, reasoning and tool calls (one file per reply format in ``formats/``).

Knows nothing of caches or decoding.
"""
