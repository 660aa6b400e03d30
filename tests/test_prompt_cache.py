"""The prompt cache (issue 46): KV blocks shared by every session, keyed by content (tokens, images, model,
adapter, KV quantization), in RAM and in a folder, within budgets, safe across restarts and kills."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from chatkit import ChatSession, GenerateParams, PromptCache
from chatkit.cache.block_files import SUFFIX
from chatkit.cache.blocks import chain
from chatkit.cache.prompt import default_prompt_cache
from chatkit.errors import InvalidParamsError

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_ledger_matches_cache, fresh_reply
from mlx_lm.models.cache import KVCache

GREEDY = GenerateParams(max_tokens=6, temperature=0.0)
RULES = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in words of {i % 7 + 2} letters." for i in range(40))


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe")


def build(lm, pc="default", *, instructions=RULES, **options):
    b = ChatSession.builder(lm).generate_params(GREEDY.copy()).instructions(instructions)
    if pc != "default":
        b = b.prompt_cache(pc)
    for name, value in options.items():
        b = getattr(b, name)(*value) if isinstance(value, tuple) else getattr(b, name)(value)
    return b.build()


def turn(session, prompt, **options):
    with session.stream_respond(prompt, **options) as stream:
        for _ in stream:
            pass
    return list(stream.tokens)


def without_cache(lm, prompts, **options):
    s = build(lm, None, **options)
    return [turn(s, p) for p in prompts]


def test_a_new_session_takes_the_shared_instructions_from_its_models_cache(lm, default_prompt_cache_on):
    first = build(lm)
    turn(first, "Hello!")
    pc = default_prompt_cache(lm)
    assert first.prompt_cache is pc  # what a user reads usage() from
    before = pc.usage()
    assert before.blocks >= 1 and before.ram_bytes > 0
    second = build(lm)
    reply = turn(second, "What is the time?")
    stats = second.last_stats
    assert stats.reused_tokens > pc.block_tokens  # whole blocks, then the head of the partial one after them
    assert stats.prefilled_tokens < 20  # token-exact: only the new message and what follows it
    assert stats.plan == "append"
    assert pc.usage().hits > before.hits
    assert reply == without_cache(lm, ["What is the time?"])[0]
    assert_ledger_matches_cache(second)


def test_off_for_one_session(lm, default_prompt_cache_on):
    pc = PromptCache(block_tokens=16)
    turn(build(lm, pc), "Hello!")
    off = build(lm, None)
    turn(off, "Hello!")
    assert off.last_stats.reused_tokens == 0 and off.prompt_cache is None


def test_replies_over_cached_blocks_equal_replies_without_them_turn_after_turn(lm):
    pc = PromptCache(block_tokens=16)
    prompts = ["Hello!", "Tell me about the sea.", "And the mountains?"]
    turn(build(lm, pc), "Hello!")  # fills the cache with the instructions and the first exchange
    s = build(lm, pc)
    ours = [turn(s, p) for p in prompts]
    assert s.last_stats.reused_tokens > 0
    assert ours == without_cache(lm, prompts)
    assert_ledger_matches_cache(s)
    # Another session with the whole conversation as history starts from its blocks.
    other = ChatSession.builder(lm).generate_params(GREEDY.copy()).instructions(RULES).history(s.history) \
        .prompt_cache(pc).build()
    turn(other, "Bye.")
    assert other.last_stats.reused_tokens >= len(s._state.conversation.cache.ledger.tokens) // 16 * 16 - 16


def test_a_turn_whose_own_cache_misses_looks_in_the_prompt_cache(lm):
    pc = PromptCache(block_tokens=16)
    s = build(lm, pc)
    turn(s, "Hello!")
    s.release_cache()
    expected = without_cache(lm, ["Hello!", "Again."])[1]
    assert turn(s, "Again.") == expected
    assert s.last_stats.reused_tokens >= 16


def test_another_adapter_or_scale_never_reuses_a_block(lm, tmp_path):
    from chatkit.testing.adapters import random_adapter

    adapter = lm.adapter(random_adapter(tmp_path / "a", lm))
    pc = PromptCache(block_tokens=16)
    turn(build(lm, pc), "Hi.")
    with_adapter = build(lm, pc, adapter=adapter)
    turn(with_adapter, "Hi.")
    assert with_adapter.last_stats.reused_tokens == 0  # the base model's blocks are not this adapter's
    half = build(lm, pc, adapter=(adapter, 0.5))
    turn(half, "Hi.")
    assert half.last_stats.reused_tokens == 0  # nor another scale's
    again = build(lm, pc, adapter=adapter)
    assert turn(again, "Hi.") == without_cache(lm, ["Hi."], adapter=adapter)[0]
    assert again.last_stats.reused_tokens > 0
    base = build(lm, pc)
    turn(base, "Hi.")
    again.set_adapter(None)  # a switch binds the session to the base model's blocks
    expected = fresh_reply(again, "Hi.")
    assert turn(again, "Hi.") == expected
    assert again.last_stats.reused_tokens > 0


def test_kv_quantization_never_shares_blocks_with_another(lm):
    pc = PromptCache(block_tokens=16)
    turn(build(lm, pc), "Hi.")
    eight = build(lm, pc, kv_bits=8)
    turn(eight, "Hi.")
    assert eight.last_stats.reused_tokens == 0
    four = build(lm, pc, kv_bits=4)
    turn(four, "Hi.")
    assert four.last_stats.reused_tokens == 0
    again = build(lm, pc, kv_bits=8)
    got = [turn(again, "Hi.")]
    assert again.last_stats.reused_tokens > 0
    assert_ledger_matches_cache(again)
    got.append(turn(again, "More."))
    assert got == without_cache(lm, ["Hi.", "More."], kv_bits=8)  # over quantized blocks, as without them


def test_a_rotating_cache_is_skipped_cleanly(lm):
    pc = PromptCache(block_tokens=16)
    s = build(lm, pc, max_kv_size=64)
    turn(s, "Hi.")
    turn(s, "Again.")
    assert pc.usage().blocks == 0
    assert build(lm, pc, max_kv_size=64).respond("Hi.") is not None


def test_images_key_their_blocks_by_content():
    from chatkit.testing.vision import tiny_vision_model

    lm = tiny_vision_model("qwen2_vl")
    pictures = [np.random.default_rng(n).integers(0, 255, (60, 70, 3), dtype=np.uint8) for n in (1, 2)]
    text = "Describe this picture in detail, please, and say what its colours are. " * 3
    pc = PromptCache(block_tokens=8)

    def session(cache):
        return ChatSession.builder(lm).generate_params(GREEDY.copy()).prompt_cache(cache).build()

    first = session(pc)
    turn(first, text, images=[pictures[0]])
    (span,) = first._state.conversation.cache.ledger.images
    other = session(pc)
    other_reply = turn(other, text, images=[pictures[1]])  # same tokens, other pixels
    assert other.last_stats.reused_tokens <= span.start
    assert other_reply == turn(session(None), text, images=[pictures[1]])
    same = session(pc)
    reply = turn(same, text, images=[pictures[0]])
    assert same.last_stats.reused_tokens > span.end  # the image's KV and the text after it
    assert reply == turn(session(None), text, images=[pictures[0]])


def layers(seed, n=64, count=2):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        c = KVCache()
        c.keys = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        c.values = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        c.offset = n
        out.append(c)
    return out


def test_lookup_gives_copies_and_the_longest_cached_run():
    pc = PromptCache(block_tokens=16)
    shared = pc.bind({"model": "m"})
    tokens = list(range(64))
    src = layers(0)
    shared.insert(tokens, src)
    assert pc.usage().blocks == 4
    n, got = shared.fetch(tokens + [99])
    assert n == 64 and got[0].offset == 64
    assert np.array_equal(np.array(got[0].keys_and_values()[0]), np.array(src[0].keys))
    assert got[0].keys.shape[-2] == 256  # room up to mlx-lm's next step: the turn's new tokens go in place
    got[0].keys[..., :4, :] = 0  # the session writes into its own arrays only
    n2, again = shared.fetch(tokens + [99])
    assert np.array_equal(np.array(again[0].keys_and_values()[0]), np.array(src[0].keys))
    assert shared.fetch(tokens)[0] == 63  # one token is always left to feed (3 blocks and 15 of the 4th)
    assert shared.fetch(tokens[:20] + [7] * 50)[0] == 20  # a block and the head of the next, where it differs
    assert pc.bind({"model": "other"}).fetch(tokens + [1]) is None  # another model: nothing
    assert shared.fetch(tokens + [99], have=64) is None  # not longer than what the session keeps
    u = pc.usage()
    assert u.hits == 4 + 4 + (3 + 1) + (1 + 1) and u.misses == 2  # a head of a block counts as a hit
    pc.clear()
    assert pc.usage().blocks == 0 and pc.usage().ram_bytes == 0


def test_ram_budget_evicts_least_recently_used():
    one = 2 * 2 * (2 * 16 * 8 * 4)  # layers x (keys, values) x bytes of a 16-token block
    pc = PromptCache(block_tokens=16, ram_bytes=3 * one)
    shared = pc.bind({"model": "m"})
    for seed in range(5):
        shared.insert([seed * 1000 + i for i in range(32)], layers(seed, 32))
        assert pc.usage().ram_bytes <= 3 * one
    u = pc.usage()
    assert u.ram_blocks == 3 and u.ram_evictions == 7 and u.evictions == 7
    assert shared.fetch([4000 + i for i in range(33)])[0] == 32  # the newest are there
    assert shared.fetch([0 + i for i in range(33)]) is None  # the oldest are gone


def test_disk_tier_survives_a_restart(lm, tmp_path):
    pc = PromptCache(tmp_path, block_tokens=16)
    turn(build(lm, pc), "Hello!")
    files = list(tmp_path.glob("*" + SUFFIX))
    assert len(files) == pc.usage().disk_blocks > 0 and pc.usage().disk_bytes == sum(f.stat().st_size for f in files)
    restarted = PromptCache(tmp_path, block_tokens=16, ram_bytes=0)
    assert restarted.usage().disk_blocks == len(files)
    s = build(lm, restarted)
    assert turn(s, "Hello!") == without_cache(lm, ["Hello!"])[0]
    assert s.last_stats.reused_tokens >= 16 * (len(files) - 2)
    restarted.clear()  # the folder is emptied, the files another process wrote included
    assert not list(tmp_path.glob("*" + SUFFIX)) and pc.usage().ram_bytes > 0 and restarted.usage().blocks == 0


def test_damaged_truncated_and_foreign_blocks_are_skipped_never_served(lm, tmp_path):
    pc = PromptCache(tmp_path, block_tokens=16)
    reference = build(lm, pc)
    turn(reference, "Hello!")
    seed = reference._state.conversation.cache.shared.seed
    keys = list(chain(seed, reference._state.conversation.cache.ledger.tokens, (), 16))
    paths = [tmp_path / f"{parent}.{key}{SUFFIX}" for parent, key in zip([seed, *keys], keys)]
    assert all(p.exists() for p in paths) and len(paths) >= 4
    data = bytearray(paths[3].read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the arrays
    paths[3].write_bytes(bytes(data))
    paths[2].write_bytes(paths[2].read_bytes()[:-100])  # truncated
    paths[1].write_bytes(paths[0].read_bytes())  # foreign: another block's file under this name
    restarted = PromptCache(tmp_path, block_tokens=16)
    s = build(lm, restarted)
    assert turn(s, "Hello!") == without_cache(lm, ["Hello!"])[0]
    assert s.last_stats.reused_tokens == 16  # only the first block, the one intact before the damage
    # The bad files met were dropped and written again from the recomputed KV; the next bad one is met next.
    fresh = PromptCache(tmp_path, block_tokens=16, ram_bytes=0)
    s2 = build(lm, fresh)
    assert turn(s2, "Hello!") == without_cache(lm, ["Hello!"])[0]
    assert s2.last_stats.reused_tokens == 32


def test_blocks_of_the_previous_format_are_recomputed_not_served(lm, tmp_path):
    """Format 1 carried SHA-256 checksums; its files are foreign to format 2 (XXH3): skipped, rewritten."""
    pc = PromptCache(tmp_path, block_tokens=16)
    turn(build(lm, pc), "Hello!")
    for path in tmp_path.glob("*" + SUFFIX):
        arrays, metadata = mx.load(str(path), return_metadata=True)
        meta = json.loads(metadata["chatkit_prompt_block"])
        meta["version"], meta["sha256"] = 1, meta.pop("xxh3")
        mx.save_safetensors(str(path), arrays, metadata={"chatkit_prompt_block": json.dumps(meta)})
    restarted = PromptCache(tmp_path, block_tokens=16, ram_bytes=0)
    s = build(lm, restarted)
    assert turn(s, "Hello!") == without_cache(lm, ["Hello!"])[0]
    assert s.last_stats.reused_tokens == 0
    again = build(lm, PromptCache(tmp_path, block_tokens=16, ram_bytes=0))  # written again in format 2
    assert turn(again, "Hello!") == without_cache(lm, ["Hello!"])[0] and again.last_stats.reused_tokens >= 16


def test_disk_budget_is_kept(lm, tmp_path):
    probe = PromptCache(tmp_path / "probe", block_tokens=16)
    turn(build(lm, probe), "Hello!")
    size = max(f.stat().st_size for f in (tmp_path / "probe").glob("*" + SUFFIX))
    pc = PromptCache(tmp_path / "small", block_tokens=16, disk_bytes=3 * size)
    for i in range(3):
        turn(build(lm, pc, instructions=f"Persona {i}. " + RULES), "Hello!")
        assert pc.usage().disk_bytes <= 3 * size
        assert sum(f.stat().st_size for f in (tmp_path / "small").glob("*" + SUFFIX)) <= 3 * size
    assert pc.usage().disk_evictions > 0
    # A restart with a smaller budget trims the folder to it.
    assert PromptCache(tmp_path / "small", block_tokens=16, disk_bytes=size).usage().disk_bytes <= size


def test_threads_share_one_cache_safely():
    pc = PromptCache(block_tokens=16, ram_bytes=40_000)
    shared = pc.bind({"model": "m"})
    errors = []

    def work(k):
        try:
            for i in range(20):
                tokens = [(k * 7 + i) % 5 * 100 + j for j in range(48)]
                shared.insert(tokens, layers(k * 100 + i, 48))
                found = shared.fetch(tokens + [1])
                assert found is None or found[1][0].offset == found[0]
                assert pc.usage().ram_bytes <= 40_000
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_the_environment_turns_the_default_off(lm, monkeypatch):
    monkeypatch.setenv("CHATKIT_PROMPT_CACHE", "off")
    assert default_prompt_cache(lm) is None
    monkeypatch.delenv("CHATKIT_PROMPT_CACHE")
    assert default_prompt_cache(lm) is default_prompt_cache(lm) is not None


def test_bad_arguments_are_refused(lm):
    for bad in ({"ram_bytes": -1}, {"disk_bytes": 1.5}, {"block_tokens": 0}, {"ram_bytes": True}):
        with pytest.raises(InvalidParamsError):
            PromptCache(**bad)
    with pytest.raises(InvalidParamsError):
        PromptCache(folder=3)
    with pytest.raises(InvalidParamsError):
        ChatSession.builder(lm).prompt_cache("yes")


WRITER = textwrap.dedent("""
    import sys, numpy as np, mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from chatkit import PromptCache
    pc = PromptCache(sys.argv[1], block_tokens=16)
    shared = pc.bind({"model": "m"})
    print("ready", flush=True)
    for i in range(100000):
        c = KVCache()
        c.keys = c.values = mx.array(np.random.default_rng(i).standard_normal((1, 4, 64, 64)).astype(np.float32))
        c.offset = 64
        shared.insert([i * 1000 + j for j in range(64)], [c] * 4)
""")


@pytest.mark.slow
def test_kill_9_during_writes_leaves_a_folder_that_loads(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*" + SUFFIX))) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    pc = PromptCache(tmp_path, block_tokens=16)  # opens: stale temporary files removed
    assert not list(tmp_path.glob("*.tmp.safetensors"))
    shared = pc.bind({"model": "m"})
    served = 0
    for i in range(pc.usage().disk_blocks // 4 + 2):
        found = shared.fetch([i * 1000 + j for j in range(65)])
        if found is not None:
            served += 1
            expected = np.random.default_rng(i).standard_normal((1, 4, 64, 64)).astype(np.float32)
            assert np.array_equal(np.array(found[1][0].keys_and_values()[0]), expected[..., : found[0], :])
    assert served >= 2


@pytest.mark.parametrize("draft", ["model", "prompt_lookup"])
def test_speculative_sessions_take_blocks_and_answer_alike(lm, draft):
    from chatkit import SpeculativeConfig
    from chatkit.testing import tiny_model

    config = SpeculativeConfig(tiny_model("qwen3", "bpe", 1) if draft == "model" else "prompt_lookup", 3)
    pc = PromptCache(block_tokens=16)
    turn(build(lm, pc, speculative=config), "Hello!")
    s = build(lm, pc, speculative=config)
    prompts = ["Hello there!", "And then?"]
    ours = [turn(s, prompts[0])]
    assert s.last_stats.reused_tokens > 0  # a new session's first prompt, from the blocks (the draft filled)
    ours.append(turn(s, prompts[1]))
    assert ours == without_cache(lm, prompts)  # greedy speculative equals plain greedy
    assert_ledger_matches_cache(s)


def test_a_session_pool_takes_blocks_for_a_new_session(lm, tmp_path):
    from chatkit import SessionPool

    pc = PromptCache(block_tokens=16)
    pool = SessionPool(lm, folder=tmp_path, max_cache_bytes=1,
                       configure=lambda b: b.instructions(RULES).generate_params(GREEDY.copy()).prompt_cache(pc))
    turn(pool.session("a"), "Hello!")
    pool.enforce_budget()  # "a" is spilled to a file: the blocks stay in the prompt cache
    b = pool.session("b")
    assert turn(b, "Good morning.") == without_cache(lm, ["Good morning."])[0]
    assert b.last_stats.reused_tokens > 16


def test_size_flags():
    import argparse

    from chatkit.cli.args import byte_size

    assert byte_size("2GB") == 2 * 10**9 and byte_size("512MiB") == 512 * 2**20 and byte_size("0") == 0
    assert byte_size("1.5k") == 1500 and byte_size("4096") == 4096
    for bad in ("lots", "-1GB", "2XB", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def chat_run(*args, stdin):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "chatkit", *args], input=stdin, capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.slow
def test_a_restarted_chat_reuses_its_blocks_from_the_folder(tmp_path):
    system = "You are the demo. " + " ".join(f"Rule {i}: be brief." for i in range(70))
    flags = ["--system", system, "--prompt-cache", str(tmp_path / "pc"), "--prompt-cache-ram", "64MiB"]
    first = chat_run(*flags, stdin="Hello!\n/stats\n")
    assert first.returncode == 0, first.stderr
    assert list((tmp_path / "pc").glob("*" + SUFFIX))
    second = chat_run(*flags, stdin="Good morning!\n/stats\n")
    assert second.returncode == 0, second.stderr
    reused = int(re.search(r"\((\d+) reused", second.stdout).group(1))
    assert reused >= 256, second.stdout
    off = chat_run("--system", system, "--prompt-cache", "off", stdin="Good morning!\n/stats\n")
    assert re.search(r"\(0 reused", off.stdout), off.stdout
    bad = chat_run("--prompt-cache", str(tmp_path / "file"), "--prompt-cache-disk", "lots", stdin="")
    assert bad.returncode == 2 and "--prompt-cache-disk" in bad.stderr


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5"])
def test_caches_that_cannot_be_cut_into_blocks_neither_give_nor_take(arch):
    from chatkit.testing import tiny_model

    other = tiny_model(arch, "bpe")
    pc = PromptCache(block_tokens=16)
    first = build(other, pc)
    turn(first, "Hello!")
    assert pc.usage().blocks == 0  # a sliding window / recurrent state: no block to give
    second = build(other, pc)
    assert turn(second, "Hello!") == without_cache(other, ["Hello!"])[0]
    assert second.last_stats.reused_tokens == 0
    assert turn(first, "Again.") is not None and first.last_stats.reused_tokens > 0  # its own cache still serves


def test_sessions_on_a_batch_engine_take_blocks_and_answer_alike(lm):
    from chatkit import BatchEngine

    pc = PromptCache(block_tokens=16)
    prompts = ["Hello there!", "And then?"]
    expected = without_cache(lm, prompts)
    with BatchEngine(lm, max_batch=4) as engine:
        turn(build(lm, pc, engine=engine), "Hello!")
        sessions = [build(lm, pc, engine=engine) for _ in range(3)]
        results, first_reuse = [[] for _ in sessions], [0] * len(sessions)

        def run(i):
            results[i].append(turn(sessions[i], prompts[0]))
            first_reuse[i] = sessions[i].last_stats.reused_tokens  # a new session's first prompt
            results[i].append(turn(sessions[i], prompts[1]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.prefix_cache is None or len(engine.prefix_cache) == 0  # the prompt cache served them
    assert results == [expected] * 3
    assert all(n > 16 for n in first_reuse), first_reuse
    for s in sessions:
        assert_ledger_matches_cache(s)
