"""The model layer: loading weights and tokenizers (MLX folders, hub ids, names, GGUF) and fingerprints.

Knows nothing of sessions, caches or decoding.
"""
