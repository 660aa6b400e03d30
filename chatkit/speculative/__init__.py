"""Draft-model speculative decoding (SpeculativeConfig, draft compatibility): arrives with its own issue."""
