"""Save a conversation, exit, and resume it in a new process.

Run: python examples/persist_and_resume.py [--model demo] [--file chat.safetensors]
The first run tells the model a fact and saves; the second (a new process) restores and asks.
"""

import argparse
import os
import subprocess
import sys

import chatkit
from chatkit import ChatSession, GenerateParams

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
parser.add_argument("--file", default="chat.safetensors")
parser.add_argument("--resume", action="store_true", help="(used by the second process)")
args = parser.parse_args()
lm = chatkit.load(args.model)

if not args.resume:
    session = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=32)).build()
    print("you> My name is Ada.")
    print("bot>", session.respond("My name is Ada."))
    print("you> What is 3 + 4?")
    print("bot>", session.respond("What is 3 + 4?"))
    size = session.save_cache(args.file)
    print(f"saved {session.cache_info().tokens} tokens to {args.file} ({size:,} bytes); resuming in a new process")
    sys.exit(subprocess.call([sys.executable, __file__, "--model", args.model, "--file", args.file, "--resume"]))

info = chatkit.inspect_cache(args.file)
print(f"[new process {os.getpid()}] {args.file}: {info.turns} turns, {info.tokens} tokens")
session = ChatSession.builder(lm).cache(args.file).build()
print("you> What is my name?")
print("bot>", session.respond("What is my name?"))
stats = session.last_stats
print(f"reused {stats.reused_tokens} of {stats.prompt_tokens} prompt tokens from the restored cache")
