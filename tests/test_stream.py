"""ResponseStream on its own, over a scripted token source: text, stop strings, commit exactly once."""

from chatkit.decode import DraftCount, TokenEvent
from chatkit.session.streams import ResponseStream
from chatkit.text.reply import Segmenter

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

EOS = 0


class PieceDetokenizer:
    """Token i (>= 1) decodes to PIECES[i]; a stand-in for mlx-lm's streaming detokenizers."""

    def __init__(self, pieces):
        self.pieces, self.text, self.finalized = pieces, "", False

    def add_token(self, token):
        self.text += self.pieces[token]

    def finalize(self):
        self.finalized = True


def make_stream(pieces, tokens, stop=(), max_tokens=100, fail_at=None):
    events = []

    def source():
        for i, t in enumerate(tokens):
            if i == fail_at:
                raise RuntimeError("boom")
            yield TokenEvent(t, mx.array([0.0]))

    class ScriptedTurn:
        """A stand-in for chatkit.session.turn.Turn: the steps a stream drives, recorded."""

        prompt_tokens, drafts = 10, DraftCount()
        eos_token_ids = frozenset([EOS])
        detokenizer = PieceDetokenizer(pieces)

        def __init__(self):
            self.max_tokens, self.stop = max_tokens, stop
            self.segmenter = Segmenter(None, stop=stop)

        def start(self):
            events.append("start")
            return 3, source()

        def commit(self, result):
            events.append(("commit", result))

        def abort(self, exc, generated=()):
            events.append(("abort", exc) if not generated else ("abort", exc, tuple(generated)))

    return ResponseStream(ScriptedTurn()), events


def test_chunks_join_to_the_text_and_eos_ends_with_stop():
    stream, events = make_stream(["", "Hel", "lo", " world"], [1, 2, 3, EOS, 2])
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == stream.text == "Hello world"
    assert [c.token for c in chunks] == [1, 2, 3, EOS]
    assert chunks[-1].finish_reason == "stop" and all(c.finish_reason is None for c in chunks[:-1])
    (kind, result), = [e for e in events if e != "start"]
    assert kind == "commit" and result.tokens == (1, 2, 3, EOS) and result.text == "Hello world"
    assert stream.stats.prompt_tokens == 10 and stream.stats.prefilled_tokens == 3
    assert stream.stats.reused_tokens == 7 and stream.stats.generation_tokens == 4


def test_max_tokens_ends_with_length():
    stream, events = make_stream(["", "a", "b"], [1, 2, 1, 2, 1], max_tokens=3)
    chunks = list(stream)
    assert stream.text == "aba" and chunks[-1].finish_reason == "length"
    assert stream.stats.finish_reason == "length"


def test_stop_string_across_tokens_is_held_back_and_cut():
    pieces = ["", "The answer", " is 4", "2.\n", "User", ": more"]
    stream, events = make_stream(pieces, [1, 2, 3, 4, 5, EOS], stop=["\nUser:"])
    chunks = list(stream)
    assert stream.text == "The answer is 42."
    assert "".join(c.text for c in chunks) == stream.text
    assert chunks[-1].finish_reason == "stop" and chunks[-1].token == 5
    assert events[-1][1].tokens == (1, 2, 3, 4, 5), "the cache holds what was generated, stop included"


def test_break_then_close_commits_once_with_what_was_shown():
    stream, events = make_stream(["", "a", "b", "c"], [1, 2, 3, 1, 2, 3, EOS])
    for i, _chunk in enumerate(stream):
        if i == 1:
            break
    stream.close()
    stream.close()
    commits = [e for e in events if e != "start"]
    assert len(commits) == 1 and commits[0][0] == "commit"
    assert commits[0][1].text == "ab" and stream.stats.finish_reason == "cancelled"
    assert list(stream) == []


def test_closing_before_iterating_aborts_without_starting():
    stream, events = make_stream(["", "a"], [1, EOS])
    with stream:
        pass
    assert events == [("abort", None)]


def test_garbage_collection_commits():
    stream, events = make_stream(["", "a"], [1, 1, 1, EOS])
    next(stream)
    del stream
    assert [e[0] for e in events if e != "start"] == ["commit"]


def test_error_in_generation_aborts_and_reraises():
    stream, events = make_stream(["", "a"], [1, 1, 1, EOS], fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        list(stream)
    kind, exc, generated = events[-1]
    assert kind == "abort" and isinstance(exc, RuntimeError)
    assert generated == (1, 1)  # what the cache may hold besides the prompt
    assert stream.closed


@given(
    pieces=st.lists(st.text(alphabet="ab\n:", min_size=0, max_size=3), min_size=1, max_size=12),
    stop=st.lists(st.text(alphabet="ab\n:", min_size=1, max_size=3), max_size=2),
)
def test_stop_strings_property(pieces, stop):
    table = [""] + pieces
    tokens = list(range(1, len(table))) + [EOS]
    stream, _ = make_stream(table, tokens, stop=stop)
    chunks = list(stream)
    # The reply stops where the first stop string to complete in the text completes (of two that end
    # at the same character, the longer), cut where that string starts: mlx-lm's stop-string matcher.
    text = "".join(pieces)
    expected = text
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if text[:end].endswith(s)]
        if hits:
            expected = text[: end - max(map(len, hits))]
            break
    assert stream.text == expected == "".join(c.text for c in chunks)
    for s in stop:
        assert s not in stream.text


def test_a_chunk_reads_its_log_probabilities_on_demand():
    from chatkit.session.results import StreamChunk

    row = mx.log(mx.array([0.1, 0.4, 0.1, 0.4]))
    chunk = StreamChunk("a", 3, logprobs=row)
    assert chunk.token_logprob() == pytest.approx(mx.log(mx.array(0.4)).item())
    assert [t for t, _ in chunk.top_logprobs(3)] == [1, 3, 0]  # most likely first; ties: lower id first
    assert [t for t, _ in chunk.top_logprobs(10)] == [1, 3, 0, 2] and chunk.top_logprobs(0) == []
    assert StreamChunk("a", 3).token_logprob() is None and StreamChunk("a", 3).top_logprobs(2) == []


def test_log_probabilities_read_on_another_thread_with_speculative_decoding(tiny):
    """An async stream's chunks are read on the event loop's thread: the speculative loop's
    log-probabilities are evaluated where they were computed, and equal a plain session's."""
    import asyncio

    from chatkit import ChatSession, GenerateParams, SpeculativeConfig

    lm = tiny("qwen3", "bpe", 0)
    params = GenerateParams(max_tokens=8)

    async def read(session):
        stream = session.astream_respond("Hi")
        return [(c.token, c.token_logprob(), c.top_logprobs(2)) async for c in stream]

    plain = asyncio.run(read(ChatSession.builder(lm).generate_params(params).build()))
    spec = asyncio.run(read(ChatSession.builder(lm).generate_params(params).speculative(SpeculativeConfig(lm, 3)).build()))
    assert [(t, [i for i, _ in top]) for t, _, top in spec] == [(t, [i for i, _ in top]) for t, _, top in plain]
    assert [lp for _, lp, _ in spec] == pytest.approx([lp for _, lp, _ in plain], abs=1e-4)
    assert all(top[0][0] == t for t, _, top in plain)  # greedy: the chosen token is the most likely
