"""How many tokens to draft next: a fixed number, or tuned from what drafting achieved so far.

The adaptive rule is a small cost model (as in the speculative decoding papers): with a per-token
acceptance rate ``a``, a step that drafts ``k`` tokens yields ``(1 - a**(k+1)) / (1 - a)`` tokens on
average and costs ``1 + c*k`` plain steps, where ``c`` is the measured extra time one drafted token
adds (drafting it plus checking it). The policy drafts the ``k`` with the best expected speed when
that beats a plain step by a margin, otherwise it decodes plainly and probes with one drafted token
now and then (at growing intervals while probes keep failing), so a draft that stops paying costs
little and one that starts paying again is found.
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO_MAX = 8  # longest adaptive draft: the best fixed lengths measured lie between 4 and 8
MARGIN = 1.05  # drafting must promise this speed-up over plain steps
DECAY = 0.9  # weight of older acceptance evidence per drafting step
SMOOTH = 0.2  # weight of a new time measurement
PROBE_MIN, PROBE_MAX = 16, 256  # plain tokens between probes while drafting does not pay
MAX_EXTRA = 1.0  # a drafted token that costs a whole plain step can never pay
PRIOR = (1.0, 2.0)  # (hits, tries) before any evidence: an acceptance of one half
REFRESH = 64  # drafting steps between plain steps that re-measure the plain step time


@dataclass
class DraftPolicy:
    """Per-session state of the draft length choice. ``fixed`` set: always that length."""

    fixed: int | None
    extra: float  # extra cost of one drafted token, in plain steps (a prior until measured)
    hits: float = 1.0  # decayed count of accepted draft tokens (the prior: PRIOR)
    tries: float = 2.0  # decayed count of draft tokens the target checked
    plain_time: float | None = None  # seconds of a plain step
    idle: int = 0  # plain tokens since the last drafting step
    probe_every: int = PROBE_MIN
    since_plain: int = 0  # drafting steps since the last plain step

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts the next draft token."""
        return self.hits / self.tries


def new_policy(num_draft_tokens: int | str, *, draft_model: bool) -> DraftPolicy:
    """The policy for a ``SpeculativeConfig.num_draft_tokens`` (an int or ``"auto"``)."""
    fixed = num_draft_tokens if isinstance(num_draft_tokens, int) else None
    return DraftPolicy(fixed=fixed, extra=0.3 if draft_model else 0.1)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one step yields on average when it checks ``k`` drafted tokens."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_length(policy: DraftPolicy, limit: int = AUTO_MAX) -> tuple[int, float]:
    """The draft length with the best expected speed relative to plain steps, and that speed."""
    a = policy.acceptance
    scores = [(expected_tokens(a, k) / (1.0 + policy.extra * k), k) for k in range(1, limit + 1)]
    speed, k = max(scores)
    return k, speed


def choose(policy: DraftPolicy) -> tuple[int, bool]:
    """How many tokens to draft in the next step (0: a plain step), and whether that is a probe."""
    if policy.fixed is not None:
        return policy.fixed, False
    if policy.plain_time is None or policy.since_plain >= REFRESH:
        return 0, False  # measure a plain step first
    k, speed = best_length(policy)
    if speed >= MARGIN:
        return k, False
    if policy.idle >= policy.probe_every:
        return 1, True
    return 0, False


def new_turn(policy: DraftPolicy) -> None:
    """A turn starts: new text, so probe at its first drafting chance however long the pause was
    (a reply that quotes the conversation is found at once, not after up to PROBE_MAX tokens)."""
    policy.idle = max(policy.idle, policy.probe_every)


def record_plain(policy: DraftPolicy, seconds: float) -> None:
    """A plain step (one token) took ``seconds``."""
    policy.plain_time = seconds if policy.plain_time is None else _smooth(policy.plain_time, seconds)
    policy.idle += 1
    policy.since_plain = 0


def record_draft(policy: DraftPolicy, drafted: int, accepted: int, seconds: float, probe: bool = False) -> None:
    """A step checked ``drafted`` tokens (``drafted >= 1``), accepted ``accepted`` and took ``seconds``;
    ``probe``: it was a probe while drafting did not pay."""
    if probe and accepted == drafted:
        policy.hits, policy.tries = PRIOR  # a probe came through: start over from the prior
    policy.hits = policy.hits * DECAY + accepted
    policy.tries = policy.tries * DECAY + accepted + (accepted < drafted)
    if policy.plain_time:
        # Clipped: one step slowed down by something else must not switch drafting off for long.
        extra = min(max(0.0, (seconds / policy.plain_time - 1.0) / drafted), MAX_EXTRA)
        policy.extra = _smooth(policy.extra, extra)
    policy.since_plain += 1
    if probe:
        paying = best_length(policy)[1] >= MARGIN
        policy.probe_every = PROBE_MIN if paying else min(2 * policy.probe_every, PROBE_MAX)
    policy.idle = 0


def record_miss(policy: DraftPolicy, probe: bool = False) -> None:
    """The drafter had nothing to propose when asked (prompt lookup found no earlier occurrence).

    Counted as one rejected draft token: asking is not free (the step must wait for the last token
    before it can look it up, so it cannot be queued ahead as a plain step is), and a drafter that
    rarely has a proposal rarely pays. Without this, text that does not repeat kept the policy
    asking at every step and decoding slower than plain steps."""
    policy.hits *= DECAY
    policy.tries = policy.tries * DECAY + 1.0
    if probe:
        policy.probe_every = min(2 * policy.probe_every, PROBE_MAX)
        policy.idle = 0


def _smooth(old: float, new: float) -> float:
    return (1.0 - SMOOTH) * old + SMOOTH * new


__all__ = ["AUTO_MAX", "DraftPolicy", "best_length", "choose", "expected_tokens", "new_policy", "new_turn",
           "record_draft", "record_miss", "record_plain"]
