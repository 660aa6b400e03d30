"""Tool rounds and segmentation: what structured turns cost.

    .venv/bin/python bench/tools.py [--rounds 12] [--tokens 128] [--history 6]
    .venv/bin/python bench/tools.py --reuse     # cache reuse per vendored template (counts, no timing)
    .venv/bin/python bench/tools.py --mcp [--quick]   # a tool round through a stdio MCP server vs a function

Two measurements on the benchmark model with Qwen3's template (``bpe-think``), each timed in
alternating rounds (A/B, then B/A, ...) after a warm-up:

* tool round: a conversation of ``--history`` exchanges, then a reply that reasons and calls a tool
  (forced with ``chatkit.testing.Scripted``). Timed: from ``session.respond(result, role=Role.TOOL,
  tool_call_id=...)`` to its first token (render, plan, prefill of the tool result and the template's
  glue, one decode step), on a fork whose cache is a real copy; against raw mlx-lm ``generate_step``
  appending the same suffix tokens to a copy of the same cache. Target: chatkit <= 1.1x raw.
* decode: tokens per second of a ``--tokens`` reply (EOS logit -1e9), the reply's text cut into
  reasoning / answer / tool-call segments by mlx-lm's ``TextStateMachine`` against the same stream
  handing the text out uncut. The reply starts in reasoning (the prompt leaves ``<think>`` open), so
  every character goes through the reasoning state's marker trie. Target: with >= 0.98x without.

``--mcp``: a whole tool round (``session.respond``: the reply calling ``calculate``, the call, the answer)
with the demo's ``calculate`` as a local Python function against the same function served over stdio by
an MCP server written with the SDK (``tests/helpers/mcp_servers.py``), alternating; and the call alone
(``call_tool``: its thread, the MCP request and reply). Target: the MCP round adds <= 5 ms.
``--quick`` runs a few rounds of everything (seconds, for a check that it runs).

``--reuse``: for each model family of ``tests/helpers/families.py`` (its test tokenizer, its real template, its
reply format forced), three questions, each answered by a tool call, the tool's result and an answer:
per turn, the tokens the cache held (the previous prompt and reply), how many the new prompt shares
with them (the template's ceiling), how many the turn reused and its plan. Counts, not times: any
machine gives the same table (tests/test_families.py checks reused == shared for every turn).
"""

from __future__ import annotations

import argparse
import gc
import time

import chatkit.session.turn
from chatkit import ChatSession, GenerateParams, Role
from chatkit.testing import Scripted
from chatkit.testing.templates import QWEN3
from chatkit.text.reply import Piece, PieceKind, Segmenter

import mlx.core as mx
from _common import OtherLoad, add_quick, clone, describe, load_model, median, quick, wait_until_quiet
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

HISTORY_TURN = (
    "Here is some background for the conversation, about the castle, its towers, its gates and "
    "the villages in the valley below, which trade wool and cheese with the towns by the river. "
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = '<think>\nThe user asks for the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = '{"city": "Paris", "sky": "sunny", "temperature_c": 21}'
THINK_OPEN = QWEN3.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
)


def tool_round_case(lm, history: int):
    """(description, chatkit run, raw run): the time to the first token after a tool result."""
    bias = {int(e): -1e9 for e in lm.tokenizer.eos_token_ids}
    params = GenerateParams(max_tokens=24, logit_bias=bias)
    base = ChatSession.builder(lm).tools([WEATHER], tool_execution="manual").generate_params(params).build()
    for i in range(history):
        base.respond(HISTORY_TURN + f"Question {i}: what happened next?")
    base.generate_params = GenerateParams(max_tokens=80, logits_processors=[Scripted(lm.tokenizer, [CALL])])
    base.respond("What is the weather in Paris?")
    (call,) = base.pending_tool_calls
    base.generate_params = GenerateParams(max_tokens=1)
    probe = base.fork()
    probe.respond(RESULT, role=Role.TOOL, tool_call_id=call.id)
    stats = probe.last_stats
    ledger = probe._state.conversation.cache.ledger.tokens
    held = base._state.conversation.cache.ledger.tokens
    assert stats.reused_tokens == len(held) and ledger[: len(held)] == held, "a tool round appends"
    suffix = list(ledger[len(held) : stats.prompt_tokens])

    def chatkit():
        fork = base.fork()
        fork._state.conversation.cache.layers = clone(base._state.conversation.cache.layers)
        t0 = time.perf_counter()
        with fork.stream_respond(RESULT, role=Role.TOOL, tool_call_id=call.id) as stream:
            next(stream)
            return time.perf_counter() - t0

    def raw():
        cache = clone(base._state.conversation.cache.layers)
        t0 = time.perf_counter()
        steps = generate_step(mx.array(suffix, dtype=mx.uint32), lm.model, max_tokens=1, sampler=make_sampler(0.0),
                              prompt_cache=cache)
        token, _ = next(steps)
        return time.perf_counter() - t0

    return f"{len(held)} tokens in the cache, {len(suffix)} prefilled (the result and the template's glue)", chatkit, raw


class Uncut(Segmenter):
    """The stream without segmenting: every piece of text is answer text, handed out as it comes."""

    def feed(self, new: str, *, final: bool = False) -> list[Piece]:
        self.text += new
        return [Piece(PieceKind.TEXT, new)]


def decode_case(lm, n_tokens: int):
    bias = {int(e): -1e9 for e in lm.tokenizer.eos_token_ids}
    session = (ChatSession.builder(lm).chat_template(THINK_OPEN)
               .generate_params(GenerateParams(max_tokens=n_tokens, logit_bias=bias)).build())
    prompt = "Tell me a long story about a dragon who guards a castle in the mountains."

    def run(segmenter):
        chatkit.session.turn.Segmenter = segmenter  # the class a Turn builds its segmenter from
        try:
            session.clear()
            stamps = []
            with session.stream_respond(prompt) as stream:
                for chunk in stream:
                    if not stamps or chunk.token != stamps[-1][0]:
                        stamps.append((chunk.token, time.perf_counter()))
            assert stream.reasoning if segmenter is Segmenter else stream.text
            times = [t for _, t in stamps]
            return (len(times) - 1) / (times[-1] - times[0])
        finally:
            chatkit.session.turn.Segmenter = Segmenter

    return (lambda: run(Segmenter)), (lambda: run(Uncut))


def isolated_cost(lm, reps: int = 7) -> tuple[int, float]:
    """Segmenting alone, without the model: the detokenized text of a reasoning-then-answer reply fed
    through a Segmenter (stop string included) against handing the same text out uncut, token by token.
    (tokens, median extra microseconds per token)."""
    from chatkit.model import tokenizer as _tokenizer

    tok = lm.tokenizer
    text = ("<think>\n" + "The user asks about a dragon who guards a castle, and I should think about it. " * 20
            + "</think>\n\n" + "Once upon a time " * 3)
    ids = tok.encode(text, add_special_tokens=False)

    def run(segment: bool) -> float:
        detok, seg, seen = _tokenizer.new_detokenizer(tok), Segmenter(tok, stop=["STOP"]), 0
        start = time.perf_counter()
        for i in ids:
            detok.add_token(i)
            full = detok.text
            new, seen = full[seen:], len(full)
            if segment:
                seg.feed(new)
        return time.perf_counter() - start

    extra = sorted((run(True) - run(False)) / len(ids) * 1e6 for _ in range(reps))
    return len(ids), extra[len(extra) // 2]


def alternate(a, b, rounds: int):
    for f in (a, b, a, b):
        f()
    out = []
    for r in range(rounds):
        pair = {}
        for label in (("a", "b") if r % 2 == 0 else ("b", "a")):
            gc.collect()
            pair[label] = (a if label == "a" else b)()
        out.append((pair["a"], pair["b"]))
    return out


def reuse_table(exchanges: int = 3) -> None:
    """Reuse per template over ``exchanges`` questions with a tool call each (see the module docstring)."""
    import sys
    import warnings
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers.families import FAMILIES, reuse_over_turns

    warnings.filterwarnings("ignore", message="This chat template does not render the tools")
    print(f"reuse per template: {exchanges} questions, each a tool call, its result and an answer; per turn after the "
          "first:\n  reused/held = the share of the previous prompt + reply the turn reused (its plan)")
    print(f"  {'family':<22}{'tool rounds (result -> reply)':<48}questions (next question -> reply)")
    for family in FAMILIES:
        steps = reuse_over_turns(family, exchanges)
        assert all(s.reused == s.shared for s in steps[1:]), family.name

        def cell(kind: str) -> str:
            parts = [f"{s.plan} {s.reused / s.held:.0%}" for s in steps[1:] if s.kind == kind]
            return ", ".join(parts)

        print(f"  {family.name:<22}{cell('tool'):<48}{cell('user')}")


def mcp_case(lm):
    """(description, local round, MCP round, local call, MCP call, the server to close)."""
    import sys
    from pathlib import Path

    from chatkit import MCPServer, ToolCall
    from chatkit.demo import calculate
    from chatkit.tools import Tool, call_tool

    server = MCPServer(command=[sys.executable, str(Path(__file__).resolve().parent.parent / "tests/helpers/mcp_servers.py"), "calculate"])
    reply = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "25 + 30"}}\n</tool_call>'

    def session(tools):
        return ChatSession.builder(lm).tools(tools).build()

    def round_of(s):
        def run():
            s.clear()
            s.generate_params = GenerateParams(max_tokens=40, logits_processors=[Scripted(lm.tokenizer, [reply, "55."])])
            t0 = time.perf_counter()
            assert s.respond("What is 25 + 30?") == "55."
            return time.perf_counter() - t0
        return run

    served = server.tools()  # the local session gets the served schemas: the two prompts are the same tokens
    local = session([Tool(t.schema, calculate) for t in served])
    remote = session([server])
    call = ToolCall("c1", "calculate", {"expression": "25 + 30"})

    def call_of(s):
        tools = list(s.config.tools)

        def run():
            t0 = time.perf_counter()
            assert call_tool(tools, call, timeout=10).content == "55"
            return time.perf_counter() - t0
        return run

    return "a tool round (call, result, answer)", round_of(local), round_of(remote), call_of(local), call_of(remote), server


def mcp_report(lm, rounds: int) -> None:
    what, local, remote, local_call, remote_call, server = mcp_case(lm)
    try:
        for label, a, b, n in ((what, local, remote, rounds), ("the call alone (call_tool)", local_call, remote_call, 10 * rounds)):
            rows = alternate(a, b, n)
            added = median([y - x for x, y in rows])
            print(f"\n{label}, ms (local function | stdio MCP server | added)")
            for i, (x, y) in enumerate(rows[:12]):
                print(f"  round {i + 1:<3} {1e3 * x:7.2f} {1e3 * y:7.2f} {1e3 * (y - x):+7.2f}")
            print(f"  median   {1e3 * median([x for x, _ in rows]):7.2f} {1e3 * median([y for _, y in rows]):7.2f} "
                  f"{1e3 * added:+7.2f}  (median of the per-round differences)")
        print(f"target MCP adds <= 5 ms to a round: {'met' if added <= 0.005 else 'NOT met'} ({1e3 * added:.2f} ms per call)")
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--history", type=int, default=6)
    ap.add_argument("--reuse", action="store_true", help="cache reuse per vendored template (counts only)")
    ap.add_argument("--mcp", action="store_true", help="a tool round through a stdio MCP server against a local function")
    add_quick(ap)
    args = ap.parse_args()
    if quick(args):
        args.rounds, args.tokens, args.history = 2, 16, 2
    if args.reuse:
        reuse_table()
        return
    lm = load_model("bpe-think")
    print(describe(lm))
    if args.mcp:
        load = OtherLoad()
        mcp_report(lm, args.rounds)
        print(load.report())
        return
    what, ck, raw = tool_round_case(lm, args.history)
    with_seg, without = decode_case(lm, args.tokens)
    print(wait_until_quiet())
    load = OtherLoad()

    rows = alternate(ck, raw, args.rounds)
    print(f"\ntool round: {what}; time to the first token, ms (chatkit | raw mlx-lm | ratio)")
    for i, (a, b) in enumerate(rows):
        print(f"  round {i + 1:<3} {1e3 * a:7.2f} {1e3 * b:7.2f} {a / b:6.3f}")
    ratio = median([a / b for a, b in rows])
    print(f"  median   {1e3 * median([a for a, _ in rows]):7.2f} {1e3 * median([b for _, b in rows]):7.2f}  "
          f"median of the per-round ratios {ratio:.3f}")
    print(f"target chatkit <= 1.1x raw: {'met' if ratio <= 1.1 else 'NOT met'} ({ratio:.3f})")

    rows = alternate(with_seg, without, args.rounds)
    print(f"\ndecode: {args.tokens} tokens, reply in reasoning; tok/s (segmented | uncut | ratio)")
    for i, (a, b) in enumerate(rows):
        print(f"  round {i + 1:<3} {a:7.1f} {b:7.1f} {a / b:6.3f}")
    ratio = median([a / b for a, b in rows])
    print(f"  median   {median([a for a, _ in rows]):7.1f} {median([b for _, b in rows]):7.1f}  "
          f"median of the per-round ratios {ratio:.3f}")
    print(f"target segmented >= 0.98x uncut: {'met' if ratio >= 0.98 else 'NOT met'} ({ratio:.3f})")
    n, extra_us = isolated_cost(lm)
    step_us = 1e6 / median([b for _, b in rows])
    print(f"segmenting alone: {extra_us:.1f} us per token over {n} tokens = {extra_us / step_us:.3%} of a "
          f"{step_us / 1e3:.1f} ms decode step here -> segmented/uncut ~ {step_us / (step_us + extra_us):.4f}")
    print(load.report())


if __name__ == "__main__":
    main()
