"""Test helpers: model families with their scripted replies, cache-file surgery, the distributed session script."""
