"""Draft models inside a BatchEngine (issue 47): rows sharing a draft model draft together in one
batched draft cache, the target verifies every row in one pass, each row accepts and trims on its own.
Greedy tokens are those of each session alone, with rows joining and leaving mid-draft, turns ending
at max_tokens or EOS inside an accepted run, a reader closing mid-run, next to prompt lookup and plain
rows; after every turn the draft cache holds exactly a prefix of the conversation (invariant 1) and
the next turn reuses it."""

import os

from chatkit import BatchEngine, GenerateParams, SpeculativeConfig
from chatkit.cache._mlx import layer_offset

import mlx.core as mx
import pytest
from conftest import assert_ledger_matches_cache, cache_state, fresh_reply, session_for
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache
from test_batch import Runner, gate, params_for, prompt_of, run_all, turn_tokens
from test_batch_lookup import HISTORY, copying


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe")


@pytest.fixture(scope="module")
def poor():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe", 1)  # random weights of another seed: mostly rejected


def alone(lm, prompt, params, **options):
    return turn_tokens(session_for(lm, params=params.copy(), **options), prompt)


def assert_draft_cache_holds_the_conversation(session, draft):
    """Invariant 1 for the draft: its cache holds ``draft_length`` tokens, and they are the ledger's first
    ones (its keys equal a fresh prefill of them)."""
    assert_ledger_matches_cache(session)
    state = cache_state(session)
    n = state.draft_length
    assert layer_offset(state.draft_layers) == n <= len(state.ledger)
    if not n:
        return
    fresh = make_prompt_cache(draft.model)
    draft.model(mx.array([list(state.ledger.tokens[:n])]), cache=fresh)
    for mine, theirs in zip(state.draft_layers, fresh):
        assert mx.allclose(mine.keys[..., :n, :], theirs.keys[..., :n, :], atol=1e-4).item()


def test_four_sessions_with_a_draft_batched_give_their_tokens_alone_and_keep_their_draft_caches(lm, poor):
    cases = [  # (prompt, params, spec): an agreeing draft (the target itself), a poor one, auto, a long run
        (prompt_of(14), params_for(lm, 40, no_eos=True), SpeculativeConfig(lm, 4)),
        (prompt_of(9, 3), params_for(lm, 14, no_eos=True), SpeculativeConfig(poor, 2)),
        (prompt_of(20, 5), params_for(lm, 20, no_eos=True), SpeculativeConfig(lm)),
        # runs of 6 drafts: max_tokens cuts the last run short (a row drafts no further than it may hand out)
        (prompt_of(6, 7), params_for(lm, 9, no_eos=True), SpeculativeConfig(lm, 6)),
    ]
    expected = [alone(lm, p, params, speculative=spec) for p, params, spec in cases]
    with BatchEngine(lm, max_batch=4, prefill_step_size=64) as engine:
        # The first waits for the second before its first step, and for the last two at its 20th processor
        # call: its 3rd step at the earliest (a drafting step calls it 4 times in the draft pass, 5 in the
        # verifying one), after its first token was handed out (its 2nd step), which starts the last two.
        held = cases[0][1].copy(logits_processors=[gate(engine, {1: 2, 20: 4})])
        first = Runner(session_for(lm, params=held, engine=engine, speculative=cases[0][2]), cases[0][0], signal_at=1)
        runners = [first] + [  # one at once, two while the first drafts
            Runner(session_for(lm, params=params.copy(), engine=engine, speculative=spec), p,
                   after=None if i == 1 else first.signal)
            for i, (p, params, spec) in enumerate(cases[1:], 1)
        ]
        run_all(runners)
        assert [r.error for r in runners] == [None] * 4
        assert [r.tokens for r in runners] == expected
        assert engine.turns == 4 and engine.peak_batch >= 3  # every turn decoded in the batch
        stats = [r.session.last_stats for r in runners]
        # The draft is the target itself: (all but) every draft accepted (a batch of another shape may round
        # a near tie the other way)
        assert stats[0].draft_tokens_accepted >= 0.8 * stats[0].draft_tokens_proposed > 0
        assert stats[3].draft_tokens_accepted >= 0.8 * stats[3].draft_tokens_proposed > 0
        assert stats[1].draft_tokens_accepted < stats[1].draft_tokens_proposed
        for r, (_, _, spec) in zip(runners, cases):
            assert_draft_cache_holds_the_conversation(r.session, spec.draft)
        fixed = [i for i, (_, _, spec) in enumerate(cases) if spec.num_draft_tokens != "auto"]
        for i in fixed:  # the draft's cache came back with the reply's tokens, not just the prompt
            assert cache_state(runners[i].session).draft_length > stats[i].prompt_tokens
        # The next turns (batched again) reuse both caches and give the tokens a fresh session gives.
        nexts = [fresh_reply(r.session, "And then?", speculative=spec) for r, (_, _, spec) in zip(runners, cases)]
        again = [Runner(r.session, "And then?") for r in runners]
        run_all(again)
        assert [r.error for r in again] == [None] * 4
        assert [r.tokens for r in again] == nexts
        for r, (_, _, spec) in zip(again, cases):
            assert r.session.last_stats.reused_tokens > 0
            assert_draft_cache_holds_the_conversation(r.session, spec.draft)
        assert r.session.last_stats.draft_tokens_accepted >= 0.8 * r.session.last_stats.draft_tokens_proposed > 0


def eos_after(lm, n):
    """A logits processor that forces EOS where it is shown ``marks["at"]`` tokens (a pure function of
    the tokens shown, so the draft and the target agree on it)."""
    eos = min(lm.tokenizer.eos_token_ids)
    marks = {}

    def process(tokens, logits):
        return logits + 1e4 * (mx.arange(logits.shape[-1]) == eos) if tokens.size == marks["at"] else logits

    return process, marks


def test_mixed_rows_draft_lookup_and_plain_with_eos_inside_a_run_and_a_reader_leaving_mid_run(lm, poor):
    eos, marks = eos_after(lm, 7)
    probe = session_for(lm, params=GenerateParams(max_tokens=1))
    probe.respond("Stop soon.")
    marks["at"] = probe.last_stats.prompt_tokens + 7
    cases = [  # (prompt, params, options)
        (prompt_of(11), params_for(lm, 24, no_eos=True), {"speculative": SpeculativeConfig(lm, 5)}),
        # the reply ends on EOS inside a run of 5 accepted drafts: the tokens after it are never handed out
        ("Stop soon.", GenerateParams(max_tokens=30, temperature=0.0, logits_processors=[eos]),
         {"speculative": SpeculativeConfig(lm, 5)}),
        ("And again.", copying(lm, 20), {"speculative": SpeculativeConfig("prompt_lookup", 4), "history": HISTORY}),
        (prompt_of(8, 2), params_for(lm, 16, no_eos=True), {}),
        (prompt_of(13, 4), params_for(lm, 18, no_eos=True), {"speculative": SpeculativeConfig(poor, 3)}),
        # the reader stops after 6 tokens, inside a run: the turn leaves mid-draft
        (prompt_of(10, 9), params_for(lm, 30, no_eos=True), {"speculative": SpeculativeConfig(lm, 4)}),
    ]
    expected = [alone(lm, p, params, **options) for p, params, options in cases]
    with BatchEngine(lm, max_batch=6) as engine:
        hold = gate(engine, {1: len(cases)})  # the first's first step waits for all of them: one batch
        sessions = [session_for(lm, params=params.copy(logits_processors=[hold]) if i == 0 else params.copy(),
                                engine=engine, **options)
                    for i, (_, params, options) in enumerate(cases)]
        runners = [Runner(s, p) for s, (p, _, _) in zip(sessions, cases)]
        runners[-1].close_at = 6
        run_all(runners)
        assert [r.error for r in runners] == [None] * len(cases)
        assert [r.tokens for r in runners[:-1]] == expected[:-1]
        assert runners[-1].tokens == expected[-1][:6]
        assert engine.turns == len(cases) and engine.peak_batch >= 4
        stats = [s.last_stats for s in sessions]
        assert stats[1].finish_reason == "stop" and len(expected[1]) == 8 and stats[1].draft_tokens_accepted > 0
        assert stats[2].draft_tokens_accepted > 0 and stats[3].draft_tokens_proposed == 0
        assert stats[-1].finish_reason == "cancelled"
        for s, (_, _, options) in zip(sessions, cases):
            spec = options.get("speculative")
            if spec is not None and spec.draft_model is not None:
                assert_draft_cache_holds_the_conversation(s, spec.draft)
            else:
                assert_ledger_matches_cache(s)
        left = sessions[-1]  # its next turn, alone in the engine, reuses both caches
        expect_next = fresh_reply(left, "And then?", speculative=cases[-1][2]["speculative"])
        assert turn_tokens(left, "And then?") == expect_next
        assert left.last_stats.reused_tokens > 0
        assert_draft_cache_holds_the_conversation(left, lm)


def test_a_draft_row_copying_the_conversation_next_to_a_lookup_row(lm):
    """A draft model shaped by the row's logits processors (it copies as the target does) next to prompt
    lookup over the same history: both accept long runs; tokens as alone."""
    cases = [{"speculative": SpeculativeConfig(lm, 4)}, {"speculative": SpeculativeConfig("prompt_lookup", 4)}]
    params = copying(lm, 30)
    expected = [alone(lm, "And again.", params, history=HISTORY, **o) for o in cases]
    with BatchEngine(lm, max_batch=2) as engine:
        sessions = [session_for(lm, params=params.copy(), history=HISTORY, engine=engine, **o) for o in cases]
        runners = [Runner(s, "And again.") for s in sessions]
        run_all(runners)
        assert [r.error for r in runners] == [None, None]
        assert [r.tokens for r in runners] == expected
        assert all(s.last_stats.draft_tokens_accepted > 0 for s in sessions)
        assert_draft_cache_holds_the_conversation(sessions[0], lm)


KINDS = ["agree", "agree-auto", "poor", "lookup", "none"]


@hsettings(max_examples=int(os.environ.get("CHATKIT_BATCH_EXAMPLES", "3")))
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=3, max_size=5),
    lengths=st.lists(st.integers(1, 30), min_size=5, max_size=5),
    max_tokens=st.lists(st.integers(1, 16), min_size=5, max_size=5),
    joins=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_batched_draft_rows_give_their_tokens_alone(lm, poor, kinds, lengths, max_tokens, joins):
    def spec(kind):
        return {"agree": SpeculativeConfig(lm, 3), "agree-auto": SpeculativeConfig(lm), "none": None,
                "poor": SpeculativeConfig(poor, 2), "lookup": SpeculativeConfig("prompt_lookup", 3)}[kind]

    cases = [(prompt_of(lengths[i], i), params_for(lm, max_tokens[i], no_eos=i % 2 == 0), spec(k))
             for i, k in enumerate(kinds)]
    cases[0] = (cases[0][0], params_for(lm, 24, no_eos=True), SpeculativeConfig(lm, 4))
    expected = [alone(lm, p, params, speculative=s) for p, params, s in cases]
    with BatchEngine(lm, max_batch=4, prefill_step_size=16) as engine:
        first = Runner(session_for(lm, params=cases[0][1].copy(), engine=engine, speculative=cases[0][2]),
                       cases[0][0], signal_at=4)
        runners = [first] + [Runner(session_for(lm, params=params.copy(), engine=engine, speculative=s), p,
                                    after=first.signal if joins[i] else None)
                             for i, (p, params, s) in enumerate(cases[1:], 1)]
        run_all(runners)
        assert [r.error for r in runners] == [None] * len(cases)
        assert [r.tokens for r in runners] == expected
        for r, (_, _, s) in zip(runners, cases):
            if s is not None and s.draft_model is not None:
                assert_draft_cache_holds_the_conversation(r.session, s.draft)
            else:
                assert_ledger_matches_cache(r.session)


def test_a_draft_batch_catches_up_drafts_and_keeps_only_the_accepted_tokens(lm):
    """``DraftBatch`` directly, the draft the target itself: three rows whose draft caches held 0, 5 and 9
    tokens of their prompts when they joined draft together (the catch-up feeds the rest), the target
    rejects one row's second draft and another row has no room; after ``settle`` each row's draft cache
    holds exactly its accepted tokens (its keys equal a fresh prefill of them)."""
    from chatkit.cache._mlx import batch_layer
    from chatkit.decode.batch.drafts import model_drafts
    from chatkit.decode.batch.engine import _row
    from chatkit.decode.batch.job import Job
    from chatkit.decode.batch.rows import Rows

    from mlx_lm.sample_utils import greedy_sampler

    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 75))]
    rows = Rows(lm.model)
    for p, held in zip(prompts, (0, 5, 9)):
        layers, draft = make_prompt_cache(lm.model), make_prompt_cache(lm.model)
        lm.model(mx.array([p[:-1]]), cache=layers)
        if held:
            lm.model(mx.array([p[:held]]), cache=draft)
        job = Job(tuple(p[held:]), tuple(p[:held]), 8, greedy_sampler, (), layers, 512, draft=lm.model,
                  draft_layers=draft)
        rows.join([_row(job)], [batch_layer(None, [c]) for c in layers], [p[-1]])
    assert rows.plain() == []  # the prompts' last tokens fed
    ys = rows.next_tokens()
    drafts, _ = model_drafts(rows.rows, ys, [(3, False), (3, False), (0, False)], [7, 7, 0], 3)
    proposals = [drafts[r] for r in rows.rows]
    assert [len(d) for d in proposals] == [3, 3, 0]
    proposals[1][1] = (proposals[1][1] + 1) % lm.vocab_size  # the target rejects it
    out, accepted = rows.verify(proposals)
    assert accepted == [3, 1, 0]  # the draft is the target: its own drafts are accepted
    tokens = {id(r.job): [t for job, t, _, _ in out if job is r.job] for r in rows.rows}
    jobs = [r.job for r in rows.rows]
    rows.leave([0, 1, 2])
    for p, job in zip(prompts, jobs):
        line = p + tokens[id(job)]
        n = layer_offset(job.draft_back)
        # the prompt, the next token and the accepted drafts, but the last of a run accepted whole (never fed)
        assert n == len(p) + min(len(tokens[id(job)]), 3)
        fresh = make_prompt_cache(lm.model)
        lm.model(mx.array([line[:n]]), cache=fresh)
        for mine, theirs in zip(job.draft_back, fresh):
            assert mx.allclose(mine.keys[..., :n, :], theirs.keys[..., :n, :], atol=1e-4).item()
