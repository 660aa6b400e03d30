"""A minimal streaming chat loop. Run: python examples/streaming_chat.py [--model demo|ID|PATH]

Type a message, read the reply as it streams; an empty line or Ctrl-D ends.
"""

import argparse

import chatkit
from chatkit import ChatSession, GenerateParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
args = parser.parse_args()

session = (
    ChatSession.builder(chatkit.load(args.model))
    .instructions("You are a helpful assistant.")
    .generate_params(GenerateParams(max_tokens=128))
    .build()
)
while True:
    try:
        line = input("> ")
    except EOFError:
        break
    if not line.strip():
        break
    with session.stream_respond(line) as stream:
        for chunk in stream:
            print(chunk.text, end="", flush=True)
    print(f"  [{stream.stats.generation_tokens} tokens, {stream.stats.reused_tokens} prompt tokens from the cache]")
