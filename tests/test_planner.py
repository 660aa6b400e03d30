"""The reuse planner on its own: a pure function of (ledger, prompt, capabilities)."""

from chatkit.cache.ledger import Ledger
from chatkit.cache.planner import Action, Plan, common_prefix_length, plan

import pytest
from hypothesis import given
from hypothesis import strategies as st


def test_prompt_extending_the_ledger_appends_only_the_new_tokens():
    p = plan(Ledger((1, 2, 3)), [1, 2, 3, 4, 5], trimmable=True)
    assert p == Plan(Action.APPEND, 3, (4, 5))


def test_divergence_trims_to_the_common_prefix():
    p = plan(Ledger((1, 2, 3, 9, 9)), [1, 2, 3, 4], trimmable=True)
    assert p == Plan(Action.TRIM, 3, (4,))


def test_identical_prompt_still_feeds_one_token():
    p = plan(Ledger((1, 2, 3)), [1, 2, 3], trimmable=True)
    assert p == Plan(Action.TRIM, 2, (3,))


def test_untrimmable_cache_restores_the_latest_usable_checkpoint():
    p = plan(Ledger((1, 2, 3, 4, 5, 6)), [1, 2, 3, 4, 7], trimmable=False, checkpoints=[2, 3, 5])
    assert p == Plan(Action.RESTORE, 3, (4, 7))


def test_untrimmable_cache_without_checkpoint_rebuilds():
    p = plan(Ledger((1, 2, 3)), [1, 5], trimmable=False)
    assert p == Plan(Action.REBUILD, 0, (1, 5))


def test_untrimmable_cache_still_appends():
    p = plan(Ledger((1, 2)), [1, 2, 3], trimmable=False)
    assert p.action is Action.APPEND and p.suffix == (3,)


def test_empty_prompt_is_refused():
    with pytest.raises(ValueError):
        plan(Ledger(), [], trimmable=True)


@given(
    ledger=st.lists(st.integers(0, 3), max_size=12),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    trimmable=st.booleans(),
    checkpoints=st.lists(st.integers(0, 12), max_size=3),
)
def test_plan_always_leads_to_the_prompt(ledger, prompt, trimmable, checkpoints):
    checkpoints = [c for c in checkpoints if c <= len(ledger)]
    p = plan(Ledger(tuple(ledger)), prompt, trimmable=trimmable, checkpoints=checkpoints)
    assert p.suffix, "at least one token is always fed"
    kept = tuple(ledger[: p.keep])
    assert kept + p.suffix == tuple(prompt), "what stays plus what is fed is exactly the prompt"
    lcp = common_prefix_length(ledger, prompt)
    assert p.keep <= lcp
    if p.action is Action.APPEND:
        assert p.keep == len(ledger)
    if p.action is Action.TRIM:
        assert trimmable and p.keep == min(lcp, len(prompt) - 1)
    if p.action is Action.RESTORE:
        assert not trimmable and p.keep in checkpoints
    if p.action is Action.REBUILD:
        assert p.keep == 0 and not trimmable


def test_ledger_from_offset():
    assert Ledger.from_offset([5, 6, 7], 2) == Ledger((5, 6))
    assert Ledger.from_offset([5, 6, 7], 5, opaque=2) == Ledger((5, 6, 7), 2)
    assert Ledger.from_offset([5, 6, 7], 4) is None
    assert len(Ledger((1, 2), opaque=3)) == 5
