"""How many tokens to draft next: a fixed number, or tuned from what drafting achieved so far.

The adaptive rule is a small cost model (as in the speculative decoding papers), fed with wall times
measured in the session. A plain step's time is the median of the last few plain steps (queued one
ahead, so it can be shorter than a forward pass); nothing is drafted before three are measured. A
drafting round's time is measured end to end in the loop: the draft's steps, the target's pass over
the ``k + 1`` tokens, the trims and the bookkeeping, until the next step starts. Rounds are paired
with plain steps: each is divided by the plain step time measured around it (while drafting, two
plain steps re-measure it after 4 rounds, then after 8, 16 ... up to 64), and never counted cheaper
than one plain step (a round includes a step of the target: one that looks cheaper says the plain
steps were slowed). The ratios are fitted as ``base + per_token * k`` (decayed least squares, with a
weak prior; ``per_token`` at least a third of the prior's), so a round's fixed cost is told apart
from what each drafted token adds; lengths grow to at most twice the longest measured.

With a per-token acceptance ``a``, a round drafting ``k`` tokens yields ``(1 - a**(k+1)) / (1 - a)``
tokens on average. The rule, with a confidence margin: draft the best ``k`` only when its speed
beats plain steps at the pessimistic end of the estimate, ``speed >= MARGIN * (1 + Z * u)`` with
``u`` the relative standard error of the round's cost (the rounds' scatter around the fit, with a
prior scatter of NOISE plain steps counted as one round, over the decayed number of rounds; and the
plain steps' spread, a median absolute deviation). So the prior alone, or one or two rounds that
look cheap next to slow plain steps, start no run of losing rounds. Otherwise decode plainly and
probe with one drafted token: soon (every PROBE_SOON tokens) while the optimistic end says drafting
might pay, at doubling intervals (16 up to 256) while it does not, so a draft that does not pay
costs little and one that starts paying is found again. Prompt lookup also probes at the start of
each turn (a reply may quote the conversation).

What a pair costs is shared by the sessions of the process (:mod:`.costs`): a fresh session starts
from the plain step times, the fitted round costs and (for a draft model) the acceptance and probing
interval that earlier sessions learned, and drafts (or not) from its first token.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from .costs import LearnedCosts, learned, remember

AUTO_MAX = 8  # longest adaptive draft: the best fixed lengths measured lie between 4 and 8
MARGIN = 1.05  # drafting must promise this speed-up over plain steps
DECAY = 0.9  # weight of older acceptance and round-time evidence per drafting step
PROBE_MIN, PROBE_MAX = 16, 256  # plain tokens between probes while drafting does not pay
PRIOR = (1.0, 2.0)  # (hits, tries) before any evidence: an acceptance of one half
PRIOR_BASE = 1.1  # a round's cost before any is measured, in plain steps: PRIOR_BASE + extra * k
PRIOR_WEIGHT = 0.25  # weight of the prior's round without drafts (a measured round weighs 1)
PLAIN_WINDOW = 8  # plain step times kept: their median is the plain step's time
PLAIN_MIN = 3  # plain steps measured before any drafting (a turn's first steps can run cold)
REFRESH = 64  # drafting steps between plain steps that re-measure the plain step time, at most
PAIR_MIN = 4  # ... and at first: the interval starts here when drafting starts and doubles up to REFRESH
TURN_PROBES = 8  # prompt lookup probes each of a turn's first steps (a quote often starts a few tokens in)
Z = 1.64  # one-sided 95 %: drafting must pay at the pessimistic end of the cost estimate
NOISE = 0.3  # spread of a round's cost (in plain steps) assumed before any spread is measured, weight 1
PROBE_SOON = 4  # plain tokens between probes while the evidence is too thin to tell either way


@dataclass
class DraftPolicy:
    """Per-session state of the draft length choice. ``fixed`` set: always that length."""

    fixed: int | None
    extra: float  # prior cost of one drafted token, in plain steps (before any round is measured)
    lookup: bool = False  # the drafter is prompt lookup (it probes at each turn's start)
    hits: float = PRIOR[0]  # decayed count of accepted draft tokens
    tries: float = PRIOR[1]  # decayed count of draft tokens the target checked
    plain_times: list[float] = field(default_factory=list)  # the last PLAIN_WINDOW plain step times
    rounds: list[float] = field(default_factory=lambda: [0.0] * 6)  # decayed sums: w, k, k*k, r, k*r, r*r
    cost: tuple[float, float] = (PRIOR_BASE, 0.0)  # fitted (base, per_token) of a round, in plain steps
    draft: int = 0  # the length the evidence so far says pays (0: none)
    idle: int = 0  # plain tokens since the last drafting step
    probe_every: int = PROBE_MIN
    since_plain: int = 0  # drafting steps since the last plain step
    refresh: int = PAIR_MIN  # drafting steps between plain steps (PAIR_MIN doubling to REFRESH while drafting)
    longest: int = 0  # the longest draft measured: the next length is at most twice it
    confirming: bool = False  # the last probe alone said drafting pays: the next one may confirm it
    turn_probes: int = 0  # probes left at this turn's start (prompt lookup)
    key: str | None = None  # the pair's key in the process-wide registry of learned costs (costs.py)

    @property
    def plain_time(self) -> float | None:
        """Seconds of a plain step: the median of ``plain_times`` (``None`` before any)."""
        return statistics.median(self.plain_times) if self.plain_times else None

    @property
    def acceptance(self) -> float:
        """Estimated probability that the target accepts the next draft token."""
        return self.hits / self.tries


def new_policy(num_draft_tokens: int | str, *, draft_model: bool, key: str | None = None) -> DraftPolicy:
    """The policy for a ``SpeculativeConfig.num_draft_tokens`` (an int or ``"auto"``). With ``key``
    (:func:`.costs.pair_key`), an adaptive policy starts from what earlier sessions of the process
    learned about the pair and shares what it learns."""
    fixed = num_draft_tokens if isinstance(num_draft_tokens, int) else None
    policy = DraftPolicy(fixed=fixed, extra=0.3 if draft_model else 0.1, lookup=not draft_model,
                         key=key if fixed is None else None, probe_every=PROBE_SOON)
    record = learned(policy.key) if policy.key is not None else None
    if record is not None:
        policy.plain_times, policy.rounds = record.plain_times, record.rounds or policy.rounds
        policy.longest = record.longest
        if record.hits is not None and record.tries is not None:
            policy.hits, policy.tries = record.hits, record.tries
        policy.probe_every = record.probe_every or policy.probe_every
    policy.cost = _fit(policy)
    _decide(policy)
    return policy


def _share(policy: DraftPolicy) -> None:
    """The pair's record in the registry becomes this policy's evidence (a draft model's acceptance
    too; prompt lookup's depends on the conversation)."""
    if policy.key is None:
        return
    model = not policy.lookup
    remember(policy.key, LearnedCosts(policy.plain_times, policy.rounds, policy.longest, policy.hits if model else None,
                                      policy.tries if model else None, policy.probe_every if model else None))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one step yields on average when it checks ``k`` drafted tokens."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def round_cost(policy: DraftPolicy, k: int) -> float:
    """Estimated wall time of a round drafting ``k`` tokens, in plain steps (at least one)."""
    base, per_token = policy.cost
    return max(1.0, base + per_token * k)


def best_length(policy: DraftPolicy, limit: int = AUTO_MAX, acceptance: float | None = None) -> tuple[int, float]:
    """The draft length with the best expected speed relative to plain steps (at ``acceptance``, the
    estimate's by default), and that speed. At most twice the longest length measured: the cost of
    a longer round is an extrapolation."""
    limit = min(limit, max(1, 2 * policy.longest))
    a = policy.acceptance if acceptance is None else acceptance
    speed, k = max((expected_tokens(a, k) / round_cost(policy, k), k) for k in range(1, limit + 1))
    return k, speed


def choose(policy: DraftPolicy) -> tuple[int, bool]:
    """How many tokens to draft in the next step (0: a plain step), and whether that is a probe."""
    if policy.fixed is not None:
        return policy.fixed, False
    if len(policy.plain_times) < PLAIN_MIN or policy.since_plain >= policy.refresh:
        return 0, False  # measure plain steps first, and again now and then: each round is paired with them
    if policy.draft:
        return policy.draft, False
    if policy.turn_probes > 0 or policy.idle >= policy.probe_every:
        return 1, True
    return 0, False


def new_turn(policy: DraftPolicy) -> None:
    """A turn starts. Prompt lookup probes at each of its first TURN_PROBES drafting chances however
    long the pause was (a reply that quotes the conversation, perhaps after a few words of its own, is
    found at once, not after up to PROBE_MAX tokens); a draft model's agreement does not hinge on the
    turn, so it keeps its probing interval."""
    if policy.lookup:
        policy.turn_probes = TURN_PROBES


def record_plain(policy: DraftPolicy, seconds: float) -> None:
    """A plain step (one token, queued one ahead) took ``seconds``.

    The median of the last few: a mean let one slow step (a cold start, a burst of other load) make
    drafting rounds look cheap for the REFRESH rounds until the next plain step."""
    policy.plain_times = [*policy.plain_times[1 - PLAIN_WINDOW:], seconds]
    policy.idle += 1
    if policy.since_plain:  # a re-measure between drafting rounds: the next comes later if drafting still pays
        policy.refresh = min(2 * policy.refresh, REFRESH)
    policy.since_plain = 0
    if len(policy.plain_times) == PLAIN_MIN or policy.idle % PLAIN_WINDOW == 0:  # (not every step: cheap)
        _decide(policy)  # the plain steps' spread is part of the margin
        _share(policy)


def record_draft(policy: DraftPolicy, drafted: int, accepted: int, seconds: float, probe: bool = False) -> None:
    """A drafting round checked ``drafted`` tokens (``drafted >= 1``), accepted ``accepted`` and took
    ``seconds`` end to end; ``probe``: it was a probe while drafting did not pay.

    When a probe comes through and the prior with this round alone says drafting pays, the older
    rounds may have been slowed by a cold start or other load: the next probe comes soon, and when
    it says so too, the policy starts over from the prior and that round. One cheap-looking round
    (a plain step slowed by other load) no longer starts a run of losing rounds."""
    fresh = None
    if probe and accepted == drafted:
        fresh = replace(policy, hits=PRIOR[0], tries=PRIOR[1], rounds=[0.0] * 6)
        _observe(fresh, drafted, accepted, seconds)
    pays = fresh is not None and fresh.draft > 0
    if pays and (policy.confirming or policy.lookup) and fresh is not None:  # (a lookup's cost is steady)
        policy.hits, policy.tries, policy.rounds = fresh.hits, fresh.tries, fresh.rounds
        policy.cost, policy.draft, policy.longest = fresh.cost, fresh.draft, fresh.longest
    else:  # an unconfirmed cheap round is not cost evidence yet (it would tilt the fit on its own)
        _observe(policy, drafted, accepted, None if pays else seconds)
    policy.confirming = pays and not policy.draft
    policy.since_plain += 1
    if probe:
        _probed(policy, grow=not (policy.draft or policy.confirming))
    policy.idle = 0
    _share(policy)


def _probed(policy: DraftPolicy, grow: bool) -> None:
    """After a probe: the next one comes at twice the interval (``grow``: it did not pay) or soon; a
    turn's first probes keep the interval as it was, and end once drafting pays."""
    if policy.turn_probes > 0:
        policy.turn_probes = 0 if policy.draft else policy.turn_probes - 1
    elif grow and promising(policy):
        policy.probe_every = PROBE_SOON  # the evidence is too thin to tell: gather more
    else:
        policy.probe_every = max(PROBE_MIN, min(2 * policy.probe_every, PROBE_MAX)) if grow else PROBE_MIN
    policy.idle = 0


def _observe(policy: DraftPolicy, drafted: int, accepted: int, seconds: float | None) -> None:
    """The round's acceptance and cost (unless None) join the evidence; the length is decided again."""
    policy.hits = policy.hits * DECAY + accepted
    policy.tries = policy.tries * DECAY + accepted + (accepted < drafted)
    if policy.plain_time and seconds is not None:
        # Clipped: at k + 1 plain steps a round cannot pay whatever it yields, and one round slowed
        # down by something else must not weigh more than that; a round includes a step of the target,
        # so one measured below a plain step says the plain steps it is paired with were slowed down.
        ratio = min(max(seconds / policy.plain_time, 1.0), drafted + 2.0)
        policy.longest = max(policy.longest, drafted)
        sums = [s * DECAY for s in policy.rounds]
        for i, term in enumerate((1.0, drafted, drafted * drafted, ratio, drafted * ratio, ratio * ratio)):
            sums[i] += term
        policy.rounds = sums
        policy.cost = _fit(policy)
    _decide(policy)


def record_miss(policy: DraftPolicy, probe: bool = False) -> None:
    """The drafter had nothing to propose when asked (prompt lookup found no earlier occurrence).

    Counted as one rejected draft token: asking is not free (the step must wait for the last token
    before it can look it up, so it cannot be queued ahead as a plain step is), and a drafter that
    rarely has a proposal rarely pays. Without this, text that does not repeat kept the policy
    asking at every step and decoding slower than plain steps."""
    policy.hits *= DECAY
    policy.tries = policy.tries * DECAY + 1.0
    _decide(policy)
    if probe:
        _probed(policy, grow=True)
    _share(policy)


def _decide(policy: DraftPolicy) -> None:
    """Draft only when it pays at the pessimistic end of the cost estimate (see :func:`uncertainty`):
    ``speed >= MARGIN * (1 + Z * uncertainty)``."""
    k, speed = best_length(policy)
    draft = k if speed >= MARGIN * (1.0 + Z * uncertainty(policy, k)) else 0
    if not draft:
        policy.refresh = PAIR_MIN  # when drafting starts again, its first rounds are paired closely
    policy.draft = draft


def promising(policy: DraftPolicy) -> bool:
    """Whether drafting would pay at the optimistic end of the estimate (then probes come soon)."""
    k, speed = best_length(policy)
    return speed * (1.0 + Z * uncertainty(policy, k)) >= MARGIN


def uncertainty(policy: DraftPolicy, k: int) -> float:
    """The relative standard error of a round's cost in plain steps, drafting ``k`` tokens.

    Two paired parts: the rounds' scatter around the fitted cost (with a prior scatter of NOISE plain
    steps that counts as one round, so one or two rounds that happen to agree are not taken as
    certain), over the decayed count of rounds measured; and the plain step time's, from the spread of
    the plain steps each round is divided by (a median absolute deviation, so one slow plain step
    widens it a little and does not move it)."""
    w, sk, skk, sr, skr, srr = policy.rounds
    base, per_token = policy.cost
    sse = srr - 2 * (base * sr + per_token * skr) + base * base * w + 2 * base * per_token * sk + per_token ** 2 * skk
    n = w + 1.0
    rounds = math.sqrt((max(sse, 0.0) + NOISE * NOISE) / n / n) / round_cost(policy, k)
    times = policy.plain_times
    if len(times) < 2:
        return rounds
    middle = statistics.median(times)
    spread = 1.4826 * statistics.median(abs(t - middle) for t in times) / middle
    return math.hypot(rounds, spread / math.sqrt(len(times)))


def _fit(policy: DraftPolicy) -> tuple[float, float]:
    """Least squares ``ratio = base + per_token * k`` over the measured rounds and the prior: a round
    that drafts nothing costs PRIOR_BASE (the check is not queued ahead as plain steps are), and,
    weighing almost nothing, a round drafting one token ``PRIOR_BASE + extra``. While every round had
    the same length, the fit goes through the prior's base, so a cheap draft is tried longer."""
    w, sk, skk, sr, skr, _ = policy.rounds
    for k, weight in ((0, PRIOR_WEIGHT), (1, PRIOR_WEIGHT / 10)):
        r = PRIOR_BASE + policy.extra * k
        w, sk, skk, sr, skr = w + weight, sk + weight * k, skk + weight * k * k, sr + weight * r, skr + weight * k * r
    # At least a third of the prior's: a drafted token is never free (a slope near zero comes from
    # rounds of one length measured against slowed plain steps, and would make every length look free).
    per_token = max(policy.extra / 3, (w * skr - sk * sr) / (w * skk - sk * sk))
    return (sr - per_token * sk) / w, per_token


__all__ = ["AUTO_MAX", "DraftPolicy", "best_length", "choose", "expected_tokens", "new_policy", "new_turn",
           "promising", "record_draft", "record_miss", "record_plain", "round_cost", "uncertainty"]
