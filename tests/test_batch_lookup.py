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


def test_a_draft_model_session_decodes_in_the_batch(lm):
    """(Issue 47: a draft model's session no longer runs alone; tests/test_batch_draft.py covers it.)"""
    from chatkit.testing import tiny_model

    draft = {"speculative": SpeculativeConfig(tiny_model("qwen3", "bpe", 1), 3)}
    params = GenerateParams(max_tokens=10, temperature=0.0)
    with BatchEngine(lm, max_batch=2) as engine:
        session = session_for(lm, params=params.copy(), engine=engine, **draft)
        assert turn_tokens(session, prompt_of(20)) == alone(lm, prompt_of(20), params, **draft)
        assert engine.turns == 1 and session.last_stats.draft_tokens_proposed > 0


def test_rows_drafting_different_lengths_in_one_step(lm):
    """Three rows copying at once (each its earlier reply): drafts of 2, 5 and 4 tokens checked in the
    same forward passes, one stopping at max_tokens inside a run, one at EOS; next to them a lookup row
    and a plain row without processors (greedy: one argmax for all their positions)."""
    cases = [
        (copying(lm, 30), {"speculative": SpeculativeConfig("prompt_lookup", 2)}),
        (copying(lm, 13), {"speculative": SpeculativeConfig("prompt_lookup", 5)}),
        (copying(lm, 40, no_eos=False), {"speculative": SpeculativeConfig("prompt_lookup", 4)}),
        # no logits processor: greedy rows sampled in one argmax over every position of the step
        (GenerateParams(max_tokens=20, temperature=0.0), {"speculative": SpeculativeConfig("prompt_lookup", 3, ngram_min=1)}),
        (GenerateParams(max_tokens=15, temperature=0.0), {}),
    ]
    expected = [alone(lm, "And again.", params, history=HISTORY, **options) for params, options in cases]
    with BatchEngine(lm, max_batch=5) as engine:
        held = [[*params.logits_processors, gate(engine, {1: 5})] for params, _ in cases[:3]] + [[], []]
        sessions = [session_for(lm, params=params.copy(logits_processors=hold), engine=engine, history=HISTORY,
                                **options) for (params, options), hold in zip(cases, held)]
        runners = [Runner(s, "And again.") for s in sessions]
        run_all(runners)
        assert [r.error for r in runners] == [None] * 5
        assert [r.tokens for r in runners] == expected
        for s in sessions:
            assert_ledger_matches_cache(s)
        assert engine.peak_batch >= 4
    stats = [s.last_stats for s in sessions]
    assert all(s.draft_tokens_accepted > 0 for s in stats[:3])
    assert [s.finish_reason for s in stats[:3]] == ["length", "length", "stop"]


def test_the_verifying_step_accepts_per_row_and_drops_each_rows_rejections(lm):
    """``Rows.verify`` directly, greedy rows without processors (one argmax over every position): a row
    whose 4 drafts are right, one whose second draft is wrong, one without drafts; then a plain step.
    Tokens are each row's greedy continuation alone, and each row's cache is what decoding alone holds."""
    from chatkit.cache._mlx import batch_layer
    from chatkit.decode.batch.job import Job
    from chatkit.decode.batch.rows import Row, Rows

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import greedy_sampler

    def greedy_alone(prompt, n):
        cache = make_prompt_cache(lm.model)
        logits, out = lm.model(mx.array([prompt]), cache=cache), []
        for _ in range(n):
            out.append(int(mx.argmax(logits[0, -1]).item()))
            logits = lm.model(mx.array([[out[-1]]]), cache=cache)
        return out, cache

    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 75))]
    truth = [greedy_alone(p, 8) for p in prompts]
    rows, jobs = Rows(lm.model), []
    for p in prompts:  # each joins with its prompt but the last token in its cache
        layers = make_prompt_cache(lm.model)
        lm.model(mx.array([p[:-1]]), cache=layers)
        jobs.append(Job(tuple(p), (), 8, greedy_sampler, (), layers, 512))
        rows.join([Row(jobs[-1], None)], [batch_layer(None, [c]) for c in layers], [p[-1]])
    assert rows.plain() == []  # the prompts' last tokens fed: nothing handed out yet
    (t0, _), (t1, _), (t2, _) = truth
    wrong = (t1[2] + 1) % lm.vocab_size
    out, accepted = rows.verify([t0[1:5], [t1[1], wrong], []])
    assert accepted == [4, 1, 0]
    got = {id(j): [t for job, t, _, _ in out if job is j] for j in jobs}
    assert [got[id(j)] for j in jobs] == [t0[:5], t1[:2], t2[:1]]
    assert [d for job, _, _, d in out if job is jobs[0]] == [False, True, True, True, True]
    plain = rows.plain()
    assert [t for _, t, _, _ in plain] == [t0[5], t1[2], t2[1]]
    caches = rows.leave([0, 1, 2])
    for (p, (_, alone_cache)), cache, fed in zip(zip(prompts, truth), caches, (6, 3, 2)):
        assert [c.offset for c in cache] == [len(p) + fed] * len(cache)
        for mine, theirs in zip(cache, alone_cache):
            n = len(p) + fed
            assert mx.allclose(mine.keys[..., :n, :], theirs.keys[..., :n, :], atol=1e-4).item()
    assert len(rows) == 0
