"""One multi-turn session, run by tests/test_distributed.py on every rank of ``mlx.launch`` or in one process.

    python tests/helpers/distributed_session.py ARCH STRATEGY OUT_DIR [hang|die|extras [LAYERS]]
    python tests/helpers/distributed_session.py cases OUT_DIR CASE [CASE ...]

STRATEGY is tensor, pipeline or none (one process, no sharding). Each rank writes the greedy tokens of
every turn (with reuse, a stream closed early by rank 0 only, a stop string, a sampled turn whose
seed differs per rank, undo, regenerate, fork, save then restore) to OUT_DIR/tokens.rank<r>.json. With ``hang`` or ``die`` as the fourth argument, rank 1
stops answering (SIGSTOP) or dies (SIGKILL) in the middle of the second turn. With ``extras`` it runs
the other session paths instead (:func:`extras`): a tool loop, guided turns, async turns and a
SessionPool that evicts and restores, on a model whose tokenizer has a tool-call format.

``cases`` runs several of these one after the other in the same processes (the ranks start once), each
into OUT_DIR/CASE: a CASE is ``ARCH-STRATEGY`` (a plain run) or ``extras-ARCH-STRATEGY-LAYERS``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import chatkit
from chatkit import ChatSession, GenerateParams
from chatkit.testing import Scripted, tiny_model_path

import mlx.core as mx
from pydantic import BaseModel, Field


def run(arch: str, strategy: str, out: Path, fault: str | None) -> None:
    path = tiny_model_path(arch=arch, tokenizer="bpe", seed=0)
    lm = chatkit.load(path, distributed=None if strategy == "none" else strategy, distributed_timeout=10.0 if fault else 300.0)
    group = lm.distributed
    rank = group.rank if group is not None else 0
    turns: list[dict] = []

    def record(name: str, session: ChatSession, stream) -> None:
        stats = session.last_stats
        turns.append({"turn": name, "tokens": stream.tokens, "text": stream.text,
                      "reused": stats.reused_tokens if stats else None, "finish": stream.finish_reason})

    def turn(session: ChatSession, name: str, prompt: str, *, stop_after: int | None = None) -> None:
        with session.stream_respond(prompt) as stream:
            for i, _ in enumerate(stream):
                if fault and name == "second" and i == 2 and rank == 1:
                    os.kill(os.getpid(), signal.SIGSTOP if fault == "hang" else signal.SIGKILL)
                if stop_after is not None and i + 1 >= stop_after and rank == 0:
                    break  # only rank 0's user stops: the other ranks' streams end at the same token
        record(name, session, stream)

    session = (ChatSession.builder(lm).instructions("Answer briefly.")
               .generate_params(GenerateParams(max_tokens=12, temperature=0.0)).build())
    turn(session, "first", "Hello there, who are you?")
    turn(session, "second", "Tell me more about it.")
    turn(session, "closed early", "And then what happened?", stop_after=3)
    turn(session, "reuse", "Why is that so?")
    session.generate_params = GenerateParams(max_tokens=12, temperature=0.0, stop=["e"])
    turn(session, "stop string", "Say something else.")
    # Sampled, with a seed that differs per rank on purpose: rank 0's tokens are what every rank uses.
    session.generate_params = GenerateParams(max_tokens=12, temperature=1.0, seed=7 + rank)
    turn(session, "sampled", "Pick a random word.")
    session.generate_params = GenerateParams(max_tokens=12, temperature=0.0)
    session.undo()
    with session.stream_regenerate() as stream:
        for _ in stream:
            pass
    record("regenerate", session, stream)
    branch = session.fork()
    turn(branch, "fork", "A question on the branch.")
    saved = out / "chat.safetensors"
    session.save_cache(saved)
    again = ChatSession.builder(lm).cache(saved).build()
    turn(again, "restored", "After the restore, go on.")
    session.restore_cache(saved)
    turn(session, "restored in place", "And once more.")
    (out / f"tokens.rank{rank}.json").write_text(json.dumps(turns))
    if group is not None and group.sharded:
        (out / f"restore-failures.rank{rank}.json").write_text(json.dumps(restore_failures(lm, session, out, rank)))


def restore_failures(lm, session: ChatSession, out: Path, rank: int) -> dict[str, str]:
    """Restores that fail on rank 1 only: every rank must raise (the class name and message are kept)."""
    saved, mine = out / "chat.safetensors", out / f"chat.rank{rank}.safetensors"
    found = {}

    def attempt(name: str) -> None:
        try:
            ChatSession.builder(lm).cache(saved).build()
            found[name] = "restored"
        except chatkit.ChatKitError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"

    if rank == 1:
        mine.rename(mine.with_suffix(".away"))  # rank 1's file is missing
    attempt("missing on rank 1")
    if rank == 1:
        mine.with_suffix(".away").rename(mine)
    session.save_cache(out / "later.safetensors")  # one more save, of a longer conversation
    if rank == 1:
        (out / "later.rank1.safetensors").replace(mine)  # rank 1's file is of another save
    attempt("another save on rank 1")
    return found


def get_weather(city: str) -> str:
    """The current weather of a city.

    Args:
        city: The city's name.
    """
    return f"Sunny in {city}."


# ChatML with tool calls and results that show their ids (as Mistral's templates do).
IDS_TEMPLATE = """{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{%- for c in message.tool_calls %}
<tool_call>
{"id": "{{ c.id }}", "name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>tool {{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


def extras(arch: str, strategy: str, out: Path, layers: int | None) -> None:
    """Tool, guided, async and pooled turns; each rank writes what it saw to OUT_DIR/extras.rank<r>.json."""
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    path = tiny_model_path(arch=arch, tokenizer="bpe", seed=0, **overrides)
    lm = chatkit.load(path, distributed=None if strategy == "none" else strategy, distributed_timeout=60.0)
    rank = lm.distributed.rank if lm.distributed is not None else 0
    seen: list[dict] = []

    def note(name: str, tokens: list[int], **more) -> None:
        seen.append({"turn": name, "tokens": list(tokens), **more})

    def params(max_tokens: int = 12, **more) -> GenerateParams:
        return GenerateParams(max_tokens=max_tokens, temperature=0.0, **more)

    # A tool round forced by a script (random weights cannot write the format), then the model's own reply
    # to the result; then a manual round answered by the app.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    agent = (ChatSession.builder(lm).tools([get_weather])
             .generate_params(params(40, logits_processors=[Scripted(lm.tokenizer, [call])])).build())
    with agent.stream_respond("What is the weather in Paris?") as stream:
        chunks = [(c.kind, c.token) for c in stream]
    note("tool loop", [t for _, t in chunks], kinds=[k for k, _ in chunks], rounds=stream.rounds,
         history=[(m.role.value, m.content, [(c.name, c.arguments) for c in m.tool_calls]) for m in agent.history],
         reused=agent.last_stats.reused_tokens)
    # A template that renders the calls' ids: the ranks must derive the same ids to render the same prompt.
    with_ids = (ChatSession.builder(lm).tools([get_weather]).chat_template(IDS_TEMPLATE)
                .generate_params(params(40, logits_processors=[Scripted(lm.tokenizer, [call])])).build())
    with with_ids.stream_respond("What is the weather in Paris?") as stream:
        tokens = [c.token for c in stream]
    note("tool ids rendered", tokens, ids=[c.id for m in with_ids.history for c in m.tool_calls],
         reused=with_ids.last_stats.reused_tokens)
    manual = (ChatSession.builder(lm).tools([get_weather], tool_execution="manual")
              .generate_params(params(40, logits_processors=[Scripted(lm.tokenizer, [call])])).build())
    manual.respond("And now?")
    (pending,) = manual.pending_tool_calls
    with manual.stream_respond("Rain in Paris.", role="tool", tool_call_id=pending.id) as stream:
        for _ in stream:
            pass
    note("manual tool result", stream.tokens, reused=manual.last_stats.reused_tokens)

    # Guided turns: a value, a stream with partial values, a regex; then a free turn reusing the cache.
    guided = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=48, temperature=0.0, thinking=False)).build()
    with guided.stream_respond("My name is Ada and I am 36.", output=Person) as stream:
        partials = [dict(stream.partial or {}) for _ in stream]
    note("guided", stream.tokens, value=stream.value.model_dump(), partials=partials)
    with guided.stream_respond("When?", regex=r"20\d\d-\d\d-\d\d") as stream:
        for _ in stream:
            pass
    note("guided regex", stream.tokens, value=stream.value)
    guided.generate_params = params()
    with guided.stream_respond("Thanks.") as stream:
        for _ in stream:
            pass
    note("after guided", stream.tokens, reused=guided.last_stats.reused_tokens)

    # Async: arespond, a full async stream, then one that rank 0 closes early (the others follow).
    async def chat() -> None:
        session = ChatSession.builder(lm).generate_params(params()).build()
        note("arespond", [], text=await session.arespond("Hello there."))
        async with session.astream_respond("Tell me more.") as stream:
            got = [chunk.token async for chunk in stream]
        note("astream", got, reused=session.last_stats.reused_tokens)
        session.generate_params = GenerateParams(max_tokens=48, temperature=0.0, thinking=False)
        value = await session.arespond("Who?", output=Person)
        note("aguided", [], value=value.model_dump())
        session.generate_params = params()
        async with session.astream_respond("Go on.") as stream:
            async for i, _ in _enumerate(stream):
                if i == 2 and rank == 0:
                    break
        note("astream closed early", stream.tokens)

    asyncio.run(chat())

    # A pool whose budget holds one cache: every switch of conversation evicts one and restores the other.
    pool = chatkit.SessionPool(lm, folder=out / "pool", max_cache_bytes=1,
                               configure=lambda b: b.generate_params(params()))
    for i, key in enumerate(["ada", "bob", "ada", "bob", "ada"]):
        session = pool.session(key)
        with session.stream_respond(f"Turn {i} of {key}.") as stream:
            for _ in stream:
                pass
        note(f"pool {key} {i}", stream.tokens, reused=session.last_stats.reused_tokens,
             evicted=sorted(k for k in pool if pool.evicted(k)))
    pool.remove("bob")  # every rank deletes its own file (listed below, after the ranks met again)

    # A budget between the ranks' cache sizes (shards of unequal size: a pipeline over an odd split of
    # layers): every rank must still evict the same sessions, or their collectives would stop matching.
    def configure(b):
        return b.generate_params(params())

    roomy = chatkit.SessionPool(lm, folder=out / "pool2", max_cache_bytes=1 << 40, configure=configure)
    roomy.session("x").respond("Hello x.")
    info = roomy.session("x").cache_info()
    mine = mx.array([[info.nbytes + info.checkpoint_bytes]], dtype=mx.int32)
    sizes = mx.distributed.all_gather(mine).reshape(-1).tolist() if lm.distributed is not None else [mine.item()]
    tight = chatkit.SessionPool(lm, folder=out / "pool2", max_cache_bytes=min(sizes), configure=configure)
    tight.session("x").respond("Hello x.")
    with tight.session("y").stream_respond("Hello y.") as stream:
        for _ in stream:
            pass
    note("uneven pool", stream.tokens, evicted=[k for k in tight if tight.evicted(k)], sizes_differ=len(set(sizes)) > 1)
    note("pool files", [], files=sorted(p.name for p in (out / "pool").iterdir()))
    (out / f"extras.rank{rank}.json").write_text(json.dumps(seen))


async def _enumerate(stream):
    i = 0
    async for chunk in stream:
        yield i, chunk
        i += 1


def cases(out: Path, names: list[str]) -> None:
    """Each case into its own folder, in the order given (every rank runs the same order)."""
    for name in names:
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        if name.startswith("extras-"):
            _, arch, strategy, layers = name.split("-")
            extras(arch, strategy, folder, int(layers))
        else:
            arch, strategy = name.split("-")
            run(arch, strategy, folder, None)


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        cases(Path(sys.argv[2]), sys.argv[3:])
    elif len(sys.argv) > 4 and sys.argv[4] == "extras":
        extras(sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[5]) if len(sys.argv) > 5 else None)
    else:
        run(sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
