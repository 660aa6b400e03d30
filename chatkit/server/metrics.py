"""``GET /metrics``: the server's counters in Prometheus' text exposition format (version 0.0.4),
written here (no dependency). Requests by route and status, tokens in and out (and those reused from
a cache), histograms of the time to the first token and of the decode speed.

Every figure is recorded on the event loop (handlers and ``ServerState.settled`` run there), so no lock
is needed: recording a turn is a few additions. Gauges (sessions pooled, KV cache bytes) are read only
when ``/metrics`` is scraped.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from ..cache.prompt import PromptCacheUsage
from ..session.results import TurnStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
TPS_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)  # tokens per second


class Histogram:
    """A Prometheus histogram: counts per upper bound (cumulated when written), their sum and count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> Iterable[str]:
        total = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            total += n
            yield f'{name}_bucket{{le="{_number(bound)}"}} {total}'
        yield f"{name}_sum {_number(self.sum)}"
        yield f"{name}_count {self.count}"


class Metrics:
    """The counters of one running server; ``render`` writes them with the gauges it is given."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status) -> requests
        self.turns: Counter[str] = Counter()  # finish reason -> turns
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode_speed = Histogram(TPS_BUCKETS)

    def observe_request(self, method: str, route: str, status: int) -> None:
        """One request answered (``route``: the path template, e.g. ``/v1/responses/{rid}``)."""
        self.requests[(method, route, status)] += 1

    def observe_turn(self, stats: TurnStats | None) -> None:
        """One turn ended (``None``: it never started). Its time to the first token is the prefill's
        (from the turn's start, queueing excluded); the decode speed is that of the tokens after the first."""
        if stats is None:
            return
        self.turns[stats.finish_reason or "none"] += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.reused_tokens
        self.completion_tokens += stats.generation_tokens
        if stats.prefilled_tokens and stats.prompt_tps > 0:
            self.ttft.observe(stats.prefilled_tokens / stats.prompt_tps)
        if stats.generation_tokens > 1 and stats.generation_tps > 0:
            self.decode_speed.observe(stats.generation_tps)

    def render(self, gauges: Mapping[str, tuple[str, float]], counters: Mapping[str, tuple[str, float]] = {}) -> str:
        """The exposition text: the counters (and ``counters`` read elsewhere), then ``gauges`` (name -> (help,
        value))."""
        out: list[str] = []
        _family(out, "chatkit_requests_total", "counter", "HTTP requests answered, by method, route and status.",
                (f'chatkit_requests_total{{method="{m}",route="{_label(r)}",status="{s}"}} {n}'
                 for (m, r, s), n in sorted(self.requests.items())))
        _family(out, "chatkit_turns_total", "counter", "Turns generated, by finish reason.",
                (f'chatkit_turns_total{{finish_reason="{_label(f)}"}} {n}' for f, n in sorted(self.turns.items())))
        for name, what, value in (
            ("chatkit_prompt_tokens_total", "Prompt tokens of the turns (reused ones included).", self.prompt_tokens),
            ("chatkit_cached_prompt_tokens_total", "Prompt tokens reused from a KV cache, not prefilled.",
             self.cached_tokens),
            ("chatkit_completion_tokens_total", "Tokens generated.", self.completion_tokens),
        ):
            _family(out, name, "counter", what, [f"{name} {value}"])
        _family(out, "chatkit_time_to_first_token_seconds", "histogram",
                "Seconds from a turn's start to its first token (the prefill).",
                self.ttft.lines("chatkit_time_to_first_token_seconds"))
        _family(out, "chatkit_decode_tokens_per_second", "histogram",
                "Decode speed of a turn: tokens per second after the first.",
                self.decode_speed.lines("chatkit_decode_tokens_per_second"))
        for counter, (meaning, level) in counters.items():
            _family(out, counter, "counter", meaning, [f"{counter} {_number(level)}"])
        for gauge, (meaning, level) in gauges.items():
            _family(out, gauge, "gauge", meaning, [f"{gauge} {_number(level)}"])
        return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, what: str, samples: Iterable[str]) -> None:
    out += [f"# HELP {name} {what}", f"# TYPE {name} {kind}", *samples]


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def prompt_cache_series(usage: PromptCacheUsage | None) -> tuple[dict[str, tuple[str, float]], dict[str, tuple[str, float]]]:
    """The prompt cache's (counters, gauges) for ``/metrics``; none when it is off."""
    if usage is None:
        return {}, {}
    counters: dict[str, tuple[str, float]] = {
        "chatkit_prompt_cache_hits_total": ("Prompt-cache blocks served to a new prompt.", usage.hits),
        "chatkit_prompt_cache_misses_total": ("Prompt-cache lookups that stopped at a block not cached.", usage.misses),
        "chatkit_prompt_cache_ram_evictions_total": ("Prompt-cache blocks dropped from RAM for its budget.",
                                                     usage.ram_evictions),
        "chatkit_prompt_cache_disk_evictions_total": ("Prompt-cache block files deleted for the disk budget.",
                                                      usage.disk_evictions),
    }
    gauges: dict[str, tuple[str, float]] = {
        "chatkit_prompt_cache_ram_bytes": ("Bytes of prompt-cache blocks in RAM.", usage.ram_bytes),
        "chatkit_prompt_cache_disk_bytes": ("Bytes of prompt-cache block files on disk.", usage.disk_bytes),
        "chatkit_prompt_cache_blocks": ("Distinct prompt-cache blocks (RAM or disk).", usage.blocks),
    }
    return counters, gauges


__all__ = ["CONTENT_TYPE", "Histogram", "Metrics", "prompt_cache_series"]
