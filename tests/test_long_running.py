"""Robustness over time: a long session with a bounded KV cache, and many threads over a SessionPool."""

import os
import random
import resource
import threading
import time

from chatkit import ChatSession, GenerateParams, SessionBusyError, SessionPool

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, session_for

PARAMS = GenerateParams(max_tokens=8)


def rss_mb() -> float:
    """The process's resident memory now (Linux), or its peak elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


@pytest.mark.slow
def test_300_turns_with_a_bounded_kv_cache_keep_memory_flat(tiny):
    # A context window far larger than the conversation: the KV cache, not the window, is the bound.
    lm = tiny(arch="qwen3", tokenizer="bpe", max_position_embeddings=1 << 16)
    max_kv = 64
    session = session_for(lm, params=PARAMS, max_kv_size=max_kv)
    report, active, cache, kv = [], {}, {}, {}
    for turn in range(1, 301):
        session.respond(f"Turn {turn}: tell me one more thing about the river.")
        layers = cache_state(session).layers
        # The policy (README, Cache options): the transcript is whole, the model attends to the last
        # max_kv_size positions; the ledger covers the whole transcript, the cache holds max_kv_size.
        assert_ledger_matches_cache(session)
        assert all(c.keys.shape[2] <= max_kv for c in layers)
        info = session.cache_info()
        if turn % 25 == 0:
            mx.clear_cache()
            active[turn], cache[turn] = mx.get_active_memory(), info.nbytes + info.checkpoint_bytes
            kv[turn] = info.nbytes
            report.append(f"turn {turn:3}: RSS {rss_mb():6.1f} MB, MLX active {active[turn] / 2**20:5.2f} MB, "
                          f"KV {info.nbytes / 2**10:.0f} kB + checkpoints {info.checkpoint_bytes / 2**10:.0f} kB, "
                          f"transcript {len(cache_state(session).ledger)} tokens")
    print("\n" + "\n".join(report))
    assert len(session.history) == 600
    assert len(cache_state(session).ledger) > 20 * max_kv, "the conversation went far past the KV bound"
    assert info.tokens == max_kv  # cache_info() reports what the cache holds
    # Flat: the KV stopped growing once full; checkpoints (taken mid-prefill, when a rotating buffer
    # briefly holds max_kv_size + the new message) vary with the message, within a bound; MLX's memory
    # in the second half is no more than in the first (a leak of one turn's KV, ~40 kB, would add 5 MB).
    assert len({session.cache_info().nbytes} | {c for c in kv.values()}) == 1
    first, second = range(50, 176, 25), range(200, 301, 25)
    assert max(cache[t] for t in second) <= 1.05 * max(cache[t] for t in first)
    assert max(active[t] for t in second) <= 1.05 * max(active[t] for t in first)


@pytest.mark.slow
def test_many_threads_over_a_pool_commit_every_turn_once_and_replay_exactly(tiny, tmp_path):
    lm = tiny(arch="qwen3", tokenizer="bpe")
    configure = lambda b: b.generate_params(PARAMS).instructions("Be brief.")  # noqa: E731
    probe = ChatSession.builder(lm).generate_params(PARAMS).instructions("Be brief.").build()
    probe.respond("[0.0] Hello user0")
    one = probe.cache_info().nbytes
    pool = SessionPool(lm, folder=tmp_path / "pool", max_cache_bytes=3 * one, configure=configure)
    keys = [f"user{i}" for i in range(50)]
    logs: list[list[tuple[str, str, str]]] = [[] for _ in range(4)]
    busy = [0] * 4
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        rng = random.Random(w)
        try:
            for i in range(75):
                key = rng.choice(keys)
                message = f"[{w}.{i}] Hello {key}"
                while True:
                    try:
                        reply = pool.session(key).respond(message)
                        break
                    except SessionBusyError:  # another thread's turn on this session: try again
                        busy[w] += 1
                        time.sleep(0.002)  # let that turn run instead of spinning on the pool's lock
                logs[w].append((key, message, reply))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            mx.clear_streams()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []
    sent = [entry for log in logs for entry in log]
    assert len(sent) == 300

    committed = 0
    evictions = sum(1 for k in keys if pool.evicted(k))
    for key in keys:
        if key not in pool:
            continue
        history = pool.session(key).history
        pairs = [(history[i].content, history[i + 1].content) for i in range(0, len(history), 2)]
        mine = {m: r for k, m, r in sent if k == key}
        # Every turn sent to this key committed exactly once, with the reply its caller got.
        assert sorted(m for m, _ in pairs) == sorted(mine)
        assert all(mine[m] == r for m, r in pairs)
        committed += len(pairs)
        # The history equals a replay: a fresh session sent the same messages answers the same.
        replay = session_for(lm, params=PARAMS)
        assert [replay.respond(m) for m, _ in pairs] == [r for _, r in pairs], key
    assert committed == 300
    print(f"\n300 turns on {len(pool)} sessions from 4 threads: {sum(busy)} busy retries, "
          f"{evictions} sessions evicted at the end, {len(list((tmp_path / 'pool').iterdir()))} files")
