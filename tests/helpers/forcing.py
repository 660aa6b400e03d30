"""Logits processors that force a random-weight model's tokens in server tests."""

import mlx.core as mx


class Favour:
    """Pushes one token far ahead of the others at every step."""

    def __init__(self, token, weight=50.0):
        self.token, self.weight = token, weight

    def __call__(self, tokens, logits):
        return logits + self.weight * (mx.arange(logits.shape[-1]) == self.token)


class FavourFirst:
    """Pushes ``token`` at the first step it sees only (the reply opens with it, the rest is free)."""

    def __init__(self, token):
        self.token, self.calls = token, 0

    def __call__(self, tokens, logits):
        self.calls += 1
        return logits + 50.0 * (mx.arange(logits.shape[-1]) == self.token) if self.calls == 1 else logits


class Ban:
    """Keeps ``ids`` from being sampled."""

    def __init__(self, *ids):
        self.ids = ids

    def __call__(self, tokens, logits):
        return logits + mx.array([-1e9 if i in self.ids else 0.0 for i in range(logits.shape[-1])], dtype=logits.dtype)
