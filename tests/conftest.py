"""Shared fixtures: offline tiny models (built once per process by chatkit.testing)."""

import os
import tempfile

import chatkit  # noqa: F401  (loads OpenBLAS before mlx, when present)
from chatkit import ChatSession, GenerateParams
from chatkit.cache._mlx import layer_offset

import pytest
from hypothesis import HealthCheck, settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# `chatkit chat` keeps prompt-cache blocks in the user cache folder: tests (and the CLIs they start) use a
# temporary folder of their own instead.
os.environ.setdefault("CHATKIT_PROMPT_CACHE_DIR", tempfile.mkdtemp(prefix="chatkit-test-prompt-cache-"))
# Sessions share no process-wide prompt cache unless a test asks for one (tests/test_prompt_cache.py,
# tests/test_server_prompt_cache.py): the other tests count what a session reuses of its own cache, and
# every test's sessions over the same tiny model would otherwise share blocks.
os.environ["CHATKIT_PROMPT_CACHE"] = "off"


@pytest.fixture
def default_prompt_cache_on(monkeypatch):
    """The process-wide prompt cache on, as it is outside the tests."""
    monkeypatch.delenv("CHATKIT_PROMPT_CACHE")


@pytest.fixture(autouse=True)
def no_learned_draft_costs():
    """Each test's speculative sessions start without what another test's learned about the same pair
    (the process-wide registry of chatkit.decode.speculative.costs)."""
    from chatkit.decode.speculative.costs import forget

    forget()
    yield
    forget()


settings.register_profile(
    "chatkit",
    deadline=None,
    derandomize=True,  # the same examples on every run: CI failures reproduce
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("chatkit")

GREEDY = GenerateParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="session")
def tiny():
    from chatkit.testing import tiny_model

    return tiny_model


def session_for(lm, *, params=GREEDY, instructions="Be brief.", history=(), **options):
    builder = ChatSession.builder(lm).generate_params(params).history(list(history))
    if instructions is not None:
        builder = builder.instructions(instructions)
    for name, value in options.items():
        builder = getattr(builder, name)(value)
    return builder.build()


def fresh_reply(session, prompt, **options):
    """The reply of a new session with the same history: the ground truth for cache reuse (no prompt
    cache: it computes everything)."""
    options.setdefault("prompt_cache", None)
    fresh = session_for(
        session.model,
        params=session.generate_params.copy(),
        instructions=session.instructions,
        history=session.history,
        **options,
    )
    with fresh.stream_respond(prompt) as stream:
        for _ in stream:
            pass
    return stream.tokens


def cache_state(session):
    """The test seam into a session's cache state (layers, ledger, checkpoints): the one place tests
    reach past the public API."""
    return session._state.conversation.cache


def assert_ledger_matches_cache(session):
    """Invariant 1: every attention layer's offset is the ledger's length."""
    state = cache_state(session)
    if state.layers is None:
        assert len(state.ledger) == 0
        return
    offset = layer_offset(state.layers)
    if offset is not None:
        assert offset == len(state.ledger)


# pytest-timeout: pyproject.toml's default (300 s) is for the fast tier; a test of an opt-in tier without its
# own @pytest.mark.timeout gets this many seconds (its module's fixtures, set up in its first test, included:
# training a pair, fetching and converting SmolLM2, starting servers, on a loaded machine).
TIER_TIMEOUTS = {"real_model": 1200, "scripts": 1200, "clients": 900, "lint": 900, "slow": 900}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """tests/clients/ is the `clients` tier (real subprocess servers, the browser): opt-in, like `slow`.
    Opt-in tiers get their longer timeouts (TIER_TIMEOUTS)."""
    clients = config.rootpath / "tests" / "clients"
    for item in items:
        if clients in item.path.parents:
            item.add_marker(pytest.mark.clients)
        if item.get_closest_marker("timeout") is None:
            limits = [t for name, t in TIER_TIMEOUTS.items() if item.get_closest_marker(name)]
            if limits:
                item.add_marker(pytest.mark.timeout(max(limits)))
