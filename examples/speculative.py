"""Speculative decoding with the demo pair: same greedy reply, and how many draft tokens were accepted.

Run: python examples/speculative.py [--model demo --draft demo-draft]
"""

import argparse
import time

import chatkit
from chatkit import ChatSession, GenerateParams, SpeculativeConfig

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="demo")
parser.add_argument("--draft", default="demo-draft")
parser.add_argument("--num-draft", type=int, default=4)
args = parser.parse_args()
lm, draft = chatkit.load(args.model), chatkit.load(args.draft)
params = GenerateParams(max_tokens=64)
plain = ChatSession.builder(lm).generate_params(params).build()
fast = ChatSession.builder(lm).generate_params(params).speculative(SpeculativeConfig(draft, args.num_draft)).build()

for prompt in ["My name is Ada.", "What is 12 + 7?", "Spell cat.", "What is my name?"]:
    t0 = time.perf_counter()
    a = plain.respond(prompt)
    t1 = time.perf_counter()
    b = fast.respond(prompt)
    t2 = time.perf_counter()
    s = fast.last_stats
    print(f"you> {prompt}\nbot> {b}")
    print(f"     same as without draft: {a == b}; draft accepted {s.draft_tokens_accepted}/{s.draft_tokens_proposed}; "
          f"{(t1 - t0) * 1000:.0f} ms plain, {(t2 - t1) * 1000:.0f} ms speculative")
