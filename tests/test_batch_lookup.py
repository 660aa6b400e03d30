"""Prompt lookup inside a BatchEngine (issue 36, part 2): rows verify their drafts in the batch's forward
pass, with rows drafting different lengths, rows not drafting, rows joining and leaving mid-run, a
reply ending on EOS inside an accepted run, max_tokens inside a run and stop strings; greedy tokens
are those of each session alone."""

from chatkit import BatchEngine, GenerateParams, SpeculativeConfig

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, session_for
from test_batch import Runner, gate, params_for, prompt_of, run_all, turn_tokens


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe")


def copier(tokens, logits):
    """Makes a model copy its context: the token that followed the latest earlier occurrence of the
    last two tokens gets a large bonus (a pure function of the tokens shown, as in test_speculative)."""
    seen = tokens.tolist()
    for end in range(len(seen) - 1, 1, -1):
        if seen[end - 2 : end] == seen[-2:]:
            return logits + 30.0 * (mx.arange(logits.shape[-1]) == seen[end])
    return logits


def copying(lm, max_tokens, no_eos=True, **rest):
    return params_for(lm, max_tokens, no_eos).copy(logits_processors=[copier], **rest)


PASSAGE = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
HISTORY = [{"role": "user", "content": "Count for me."}, {"role": "assistant", "content": PASSAGE}]


def alone(lm, prompt, params, **options):
    return turn_tokens(session_for(lm, params=params.copy(), **options), prompt)


def test_lookup_rows_verify_in_the_batch_with_the_tokens_alone(lm):
    cases = [  # (prompt, params, options): lookup with several lengths, a plain row, an auto policy
        (f"Repeat: {PASSAGE}", copying(lm, 40), {"speculative": SpeculativeConfig("prompt_lookup", 4)}),
        (f"Say {PASSAGE} again", copying(lm, 9), {"speculative": SpeculativeConfig("prompt_lookup", 3)}),
        (prompt_of(12), params_for(lm, 14, no_eos=True), {}),
        (f"Copy: {PASSAGE} {PASSAGE}", copying(lm, 24), {"speculative": SpeculativeConfig("prompt_lookup", ngram_min=1)}),
        # the reply copies the earlier one, its end-of-turn token included: EOS inside an accepted run
        ("And again.", copying(lm, 40, no_eos=False), {"speculative": SpeculativeConfig("prompt_lookup", 6),
                                                       "history": HISTORY}),
    ]
    expected = [alone(lm, p, params, **options) for p, params, options in cases]
    with BatchEngine(lm, max_batch=4, prefill_step_size=16) as engine:
        first_params = cases[0][1].copy(logits_processors=[copier, gate(engine, {1: 3, 6: 5})])
        first = Runner(session_for(lm, params=first_params, engine=engine, **cases[0][2]), cases[0][0], signal_at=4)
        runners = [first] + [
            Runner(session_for(lm, params=params.copy(), engine=engine, **options), p,
                   after=None if i < 3 else first.signal)  # two at once, two once the first has read 4 tokens
            for i, (p, params, options) in enumerate(cases[1:], 1)
        ]
        run_all(runners)
        assert [r.error for r in runners] == [None] * len(runners)
        assert [r.tokens for r in runners] == expected
        for r in runners:
            assert_ledger_matches_cache(r.session)
        assert engine.turns == len(cases) and engine.peak_batch >= 3
        stats = [r.session.last_stats for r in runners]
    assert all(s.draft_tokens_accepted > 0 for i, s in enumerate(stats) if i in (0, 4)), [
        (s.draft_tokens_proposed, s.draft_tokens_accepted, s.finish_reason, s.generation_tokens) for s in stats]
    assert stats[4].finish_reason == "stop" and len(expected[4]) < 40  # ended on EOS, inside a drafted run
    assert stats[1].finish_reason == "length" and len(expected[1]) == 9
    assert stats[2].draft_tokens_proposed == 0


def test_a_lookup_row_stops_at_a_stop_string_and_its_next_turn_reuses_the_cache(lm):
    spec = {"speculative": SpeculativeConfig("prompt_lookup", 5)}
    params = copying(lm, 40, stop=["nine"])
    with BatchEngine(lm, max_batch=2) as engine:
        session = session_for(lm, params=params.copy(), engine=engine, history=HISTORY, **spec)
        other = Runner(session_for(lm, params=copying(lm, 30), engine=engine, **spec), f"Repeat: {PASSAGE}")
        other.start()
        reply = session.respond("And again.")
        other.join(60)
        assert other.error is None
        assert reply == session_for(lm, params=params.copy(), history=HISTORY, **spec).respond("And again.")
        assert "nine" not in reply and session.last_stats.draft_tokens_accepted > 0
        assert_ledger_matches_cache(session)
        before = len(cache_state(session).ledger)
        expected = alone(lm, "Once more.", params, history=session.history, **spec)
        assert turn_tokens(session, "Once more.") == expected
        assert session.last_stats.reused_tokens >= before - 2
        assert_ledger_matches_cache(session)


def test_a_draft_model_session_still_runs_alone_next_to_batched_lookup(lm):
    from chatkit.testing import tiny_model

    draft = {"speculative": SpeculativeConfig(tiny_model("qwen3", "bpe", 1), 3)}
    params = GenerateParams(max_tokens=10, temperature=0.0)
    with BatchEngine(lm, max_batch=2) as engine:
        session = session_for(lm, params=params.copy(), engine=engine, **draft)
        assert turn_tokens(session, prompt_of(20)) == alone(lm, prompt_of(20), params, **draft)
        assert engine.turns == 0


def test_rows_drafting_different_lengths_in_one_step(lm):
    """Three rows copying at once (each its earlier reply): drafts of 2, 5 and 4 tokens checked in the
    same forward passes, one stopping at max_tokens inside a run, one at EOS."""
    cases = [
        (copying(lm, 30), {"speculative": SpeculativeConfig("prompt_lookup", 2)}),
        (copying(lm, 13), {"speculative": SpeculativeConfig("prompt_lookup", 5)}),
        (copying(lm, 40, no_eos=False), {"speculative": SpeculativeConfig("prompt_lookup", 4)}),
    ]
    expected = [alone(lm, "And again.", params, history=HISTORY, **options) for params, options in cases]
    with BatchEngine(lm, max_batch=4) as engine:
        sessions = [session_for(lm, params=params.copy(logits_processors=[copier, gate(engine, {1: 3})]),
                                engine=engine, history=HISTORY, **options) for params, options in cases]
        runners = [Runner(s, "And again.") for s in sessions]
        run_all(runners)
        assert [r.error for r in runners] == [None] * 3
        assert [r.tokens for r in runners] == expected
        for s in sessions:
            assert_ledger_matches_cache(s)
        assert engine.peak_batch == 3
    stats = [s.last_stats for s in sessions]
    assert all(s.draft_tokens_accepted > 0 for s in stats)
    assert [s.finish_reason for s in stats] == ["length", "length", "stop"]
