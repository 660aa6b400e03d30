"""The decode boundary's typed events: a token source yields ``TokenEvent``s; a ``BatchSource`` reads its
job's queue of ``TokenEvent`` / ``Progress`` / ``End`` through the public ``Engine`` protocol (``submit``,
``release``)."""

from chatkit.cache.state import CacheState
from chatkit.decode import Request, TokenEvent
from chatkit.decode.batch.job import End, Job, Progress
from chatkit.decode.batch.source import BatchSource
from chatkit.decode.local import LocalSource
from chatkit.decode.speculative import SpeculativeConfig

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

PROMPT = list(range(20, 40)) * 2


@pytest.fixture(scope="module")
def lm():
    from chatkit.testing import tiny_model

    return tiny_model("qwen3", "bpe")


def request_for(cache, max_tokens=6, progress=None):
    plan = cache.prepare(PROMPT)
    return Request(suffix=tuple(plan.suffix), context=tuple(cache.ledger.tokens), max_tokens=max_tokens,
                   sampler=make_sampler(0.0), logits_processors=[], options=cache.options, progress=progress)


def test_a_local_source_yields_token_events(lm):
    cache = CacheState(lm.model)
    events = list(LocalSource(lm.model).generate(cache, request_for(cache)))
    assert len(events) == 6 and all(type(e) is TokenEvent for e in events)
    assert all(type(e.id) is int and not e.from_draft for e in events)
    assert all(e.logprobs.shape[-1] == lm.model.args.vocab_size for e in events)
    assert events[0].id == int(mx.argmax(events[0].logprobs))  # greedy: the id is its step's best
    drafted = CacheState(lm.model)
    lookup = list(LocalSource(lm.model, SpeculativeConfig("prompt_lookup")).generate(drafted, request_for(drafted)))
    assert all(type(e) is TokenEvent for e in lookup) and [e.id for e in lookup] == [e.id for e in events]


def test_a_job_puts_typed_events():
    job = Job((1, 2, 3), (), 4, make_sampler(0.0), (), [], 2)
    logprobs = mx.zeros((8,))
    job.progress(2)
    job.put(5, logprobs, True)
    error = RuntimeError("boom")
    job.finish(None, error)
    got = [job.out.get() for _ in range(3)]
    assert got[0] == Progress(2, 3) and got[2] == End(error) and job.finished.is_set()
    assert type(got[1]) is TokenEvent and (got[1].id, got[1].from_draft) == (5, True)


class ScriptedEngine:
    """The public ``Engine`` protocol, answering every job with the given events."""

    prefill_step_size = 64

    def __init__(self, events):
        self.events, self.submitted, self.released = events, [], []

    def check_open(self):
        pass

    def submit(self, job):
        self.submitted.append(job)
        for event in self.events(job):
            job.out.put(event)

    def release(self, job):
        self.released.append(job)
        return None  # the engine never took the session's layers


@pytest.mark.parametrize("error", [None, RuntimeError("the batch failed")])
def test_a_batch_source_reads_the_typed_queue(lm, error):
    logprobs = mx.zeros((8,))
    engine = ScriptedEngine(lambda job: [Progress(len(job.suffix) - 1, len(job.suffix)), TokenEvent(7, logprobs),
                                         TokenEvent(9, logprobs, True), End(error)])
    cache, seen = CacheState(lm.model), []
    source = BatchSource(engine, LocalSource(lm.model), None)
    tokens = source.generate(cache, request_for(cache, progress=lambda done, total: seen.append((done, total))))
    read = []
    if error is None:
        read = list(tokens)
    else:
        with pytest.raises(RuntimeError, match="the batch failed"):
            for event in tokens:
                read.append(event)
    assert [(e.id, e.from_draft) for e in read] == [(7, False), (9, True)]
    n = len(engine.submitted[0].suffix)
    assert seen == [(0, n), (n - 1, n)] and engine.released == engine.submitted
