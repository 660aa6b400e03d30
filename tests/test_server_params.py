"""chatkit serve's OpenAI request fields beyond the basics, driven by the official openai client:
tool_choice (required / named / none) and parallel_tool_calls=false held by the strict call grammar,
presence / frequency penalties as mlx-lm's processors."""

import json

from chatkit import ChatSession, GenerateParams
from chatkit.server import ServerConfig, start
from chatkit.server.wire import guided_available

import httpx
import mlx.core as mx
import openai
import pytest
from helpers.forcing import Favour
from mlx_lm.sample_utils import make_logits_processors

needs_guided = pytest.mark.skipif(not guided_available(), reason="needs the guided extra")


def bounded(name):
    """A function tool whose one string argument is bounded (a random model never ends a free string)."""
    return {"type": "function", "function": {"name": name, "description": f"The {name} of a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}


WEATHER, TIME = bounded("get_weather"), bounded("local_time")


@pytest.fixture(scope="module")
def think(tiny):
    return tiny("qwen3", "bpe-think", 0)


@pytest.fixture(scope="module")
def lm(tiny):
    return tiny("qwen3", "bpe", 0)


def client(running):
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)


def chat(c, messages, **kw):
    return c.chat.completions.create(model="any", messages=messages, **kw)


def user(text):
    return {"role": "user", "content": text}


def post(running, path, body):
    r = httpx.post(f"{running.url}{path}", json=body, timeout=60)
    return r.status_code, r.json()


def readable(tc):
    arguments = json.loads(tc.function.arguments)
    return set(arguments) == {"city"} and isinstance(arguments["city"], str) and len(arguments["city"]) <= 6



# -- tool_choice and parallel_tool_calls ------------------------------------------------------------
@needs_guided
def test_tool_choice_required_and_named_produce_calls_to_the_right_tool(think):
    with start(think, ServerConfig(defaults=GenerateParams(max_tokens=60))) as running:
        c = client(running)
        free = chat(c, [user("Weather?")], tools=[WEATHER, TIME])
        required = chat(c, [user("Weather?")], tools=[WEATHER, TIME], tool_choice="required")
        named = chat(c, [user("Weather?")], tools=[WEATHER, TIME],
                     tool_choice={"type": "function", "function": {"name": "local_time"}})
        strict = {"type": "function", "function": {**TIME["function"], "strict": True}}
        both = chat(c, [user("Weather?")], tools=[WEATHER, strict], tool_choice="required")  # two constraints agree
        r = c.responses.create(model="any", input="Weather?", tools=[
            {"type": "function", **WEATHER["function"]}, {"type": "function", **TIME["function"]}],
            tool_choice={"type": "function", "name": "get_weather"})
        several = chat(c, [user("Weather?")], tools=[WEATHER, TIME], n=2, temperature=1.0, seed=1,
                       tool_choice={"type": "function", "function": {"name": "local_time"}})
    assert not free.choices[0].message.tool_calls  # the random model does not call by itself
    for reply, names in ((required, {"get_weather", "local_time"}), (named, {"local_time"}),
                         (both, {"get_weather", "local_time"})):
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and message.tool_calls and not message.content
        assert all(tc.function.name in names and readable(tc) for tc in message.tool_calls)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(item.name == "get_weather" for item in calls) and r.tool_choice.name == "get_weather"
    # Each of n choices is held too (a fork's turn replays the same constraint from its prompt).
    for choice in several.choices:
        assert choice.message.tool_calls and all(tc.function.name == "local_time" for tc in choice.message.tool_calls)


@needs_guided
def test_parallel_tool_calls_false_gives_at_most_one_call(think):
    (start_call,) = think.tokenizer.encode("<tool_call>", add_special_tokens=False)
    params = GenerateParams(max_tokens=80, logits_processors=[Favour(start_call, weight=30.0)])
    with start(think, ServerConfig(defaults=params)) as running:
        c = client(running)
        many = chat(c, [user("Weather?")], tools=[WEATHER], tool_choice="required")
        one = chat(c, [user("Weather?")], tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
        r = c.responses.create(model="any", input="Weather?", tools=[{"type": "function", **WEATHER["function"]}],
                               tool_choice="required", parallel_tool_calls=False)
    assert len(many.choices[0].message.tool_calls) > 1
    (tc,) = one.choices[0].message.tool_calls
    assert one.choices[0].finish_reason == "tool_calls" and readable(tc)
    assert len([item for item in r.output if item.type == "function_call"]) == 1 and r.parallel_tool_calls is False


def test_tool_choice_none_is_still_held(think):
    (start_call,) = think.tokenizer.encode("<tool_call>", add_special_tokens=False)
    params = GenerateParams(max_tokens=6, logits_processors=[Favour(start_call, weight=30.0)])
    with start(think, ServerConfig(defaults=params)) as running:
        none = chat(client(running), [user("Weather?")], tools=[WEATHER], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
    ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", "named choice"),
    ({"tool_choice": "always"}, "tool_choice", "'always'"),
    ({"tool_choice": {"type": "web_search"}}, "tool_choice", "function"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
])
def test_bad_tool_choices_are_400(think, body, param, words):
    with start(think, ServerConfig(defaults=GenerateParams(max_tokens=4))) as running:
        status, data = post(running, "/chat/completions", {"messages": [user("hi")], "tools": [WEATHER], **body})
    assert status == 400 and data["error"]["param"] == param and words in data["error"]["message"]


@pytest.mark.filterwarnings("ignore:This chat template does not render the tools")
def test_forcing_calls_where_the_format_has_no_grammar_is_400(tiny):
    plain = tiny("qwen3", "spm", 0)  # a tokenizer without a tool-call format chatkit knows
    with start(plain, ServerConfig(defaults=GenerateParams(max_tokens=4))) as running:
        for body, param in (({"tool_choice": "required"}, "tool_choice"),
                            ({"parallel_tool_calls": False}, "parallel_tool_calls")):
            status, data = post(running, "/chat/completions", {"messages": [user("hi")], "tools": [WEATHER], **body})
            assert status == 400 and data["error"]["param"] == param and "leave it out" in data["error"]["message"]
        status, _ = post(running, "/chat/completions", {"messages": [user("hi")], "tools": [WEATHER]})
    assert status == 200


# -- presence and frequency penalties ---------------------------------------------------------------
def test_penalties_change_the_reply_as_mlx_lm_processors_do(lm):
    params = GenerateParams(max_tokens=24)
    with start(lm, ServerConfig(defaults=params)) as running:
        c = client(running)
        plain = chat(c, [user("Say something.")]).choices[0].message.content
        got = {name: chat(c, [user("Say something.")], **{name: 2.0}).choices[0].message.content
               for name in ("presence_penalty", "frequency_penalty")}
        status, data = post(running, "/chat/completions", {"messages": [user("hi")], "presence_penalty": 2.5})
    assert status == 400 and data["error"]["param"] == "presence_penalty" and "[-2, 2]" in data["error"]["message"]
    for name, reply in got.items():
        # The ground truth: mlx-lm's own processor, handed to an in-process session as an extra one.
        (by_hand,) = make_logits_processors(**{name: 2.0, name.replace("penalty", "context_size"): 20})
        session = ChatSession.builder(lm).generate_params(params.copy(logits_processors=[by_hand])).build()
        assert reply == session.respond("Say something.") != plain


# -- logprobs ---------------------------------------------------------------------------------------
def entries(content):
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]


def test_logprobs_are_the_models_log_softmax_and_stream_and_respond_alike(lm):
    with start(lm, ServerConfig(defaults=GenerateParams(max_tokens=8))) as running:
        c = client(running)
        r = chat(c, [user("Hi")], logprobs=True, top_logprobs=5)
        streamed = [ch for ch in chat(c, [user("Hi")], logprobs=True, top_logprobs=5, stream=True) if ch.choices]
        plain = chat(c, [user("Hi")], logprobs=True)
        off = chat(c, [user("Hi")])
        resp = c.responses.create(model="any", input="Hi", include=["message.output_text.logprobs"], top_logprobs=5)
        events = list(c.responses.create(model="any", input="Hi", include=["message.output_text.logprobs"],
                                         top_logprobs=5, stream=True))
        bad = [post(running, "/chat/completions", {"messages": [user("hi")], **body}) for body in (
            {"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": "yes"})]
    content = r.choices[0].logprobs.content
    eos = r.choices[0].finish_reason == "stop"
    assert len(content) == r.usage.completion_tokens - eos  # every token of the text, not the end of turn
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)  # greedy: the best
        assert bytes(e.bytes).decode("utf-8") == e.token
    # An independent computation: the model's forward pass over the prompt, log-softmax at step 1.
    session = ChatSession.builder(lm).build()
    prompt = lm.tokenizer.encode(session.render("Hi"), add_special_tokens=False)
    assert len(prompt) == r.usage.prompt_tokens
    logits = lm.model(mx.array([prompt]))[0, -1].astype(mx.float32)
    expected = logits - mx.logsumexp(logits)
    best = mx.argsort(-expected)[:5].tolist()
    assert [t.token for t in content[0].top_logprobs] == [lm.tokenizer.decode([t]) for t in best]
    for t, got in zip(best, content[0].top_logprobs, strict=True):
        assert got.logprob == pytest.approx(expected[t].item(), abs=1e-4)
    # Streamed chunks carry the same entries; without top_logprobs none are listed; without logprobs, none.
    assert streamed[0].choices[0].logprobs is None  # the role chunk
    assert entries(e for ch in streamed[1:] for e in ch.choices[0].logprobs.content) == entries(content)
    assert [(e.token, e.logprob, e.top_logprobs) for e in plain.choices[0].logprobs.content] == [
        (e.token, e.logprob, []) for e in content]
    assert off.choices[0].logprobs is None
    (part,) = [p for item in resp.output if item.type == "message" for p in item.content]
    assert entries(part.logprobs) == entries(content)
    deltas = [lp for ev in events if ev.type == "response.output_text.delta" for lp in ev.logprobs]
    assert entries(deltas) == entries(content)
    assert [(status, data["error"]["param"]) for status, data in bad] == [
        (400, "top_logprobs"), (400, "top_logprobs"), (400, "logprobs")]


def test_logprobs_hold_when_batched_and_with_speculative_decoding(lm):
    """Concurrent requests decoded together by the BatchEngine, and a speculative server (the model as
    its own draft: every draft accepted, the target's log-probabilities verified in one pass), give the
    entries one plain request gets."""
    from concurrent.futures import ThreadPoolExecutor

    from chatkit import SpeculativeConfig

    params = GenerateParams(max_tokens=8)
    prompts = ["Hi", "Tell me a story."]

    def ask(running, prompt):
        r = chat(client(running), [user(prompt)], logprobs=True, top_logprobs=3)
        return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in r.choices[0].logprobs.content]

    with start(lm, ServerConfig(defaults=params)) as running:
        plain = [ask(running, p) for p in prompts]
    with start(lm, ServerConfig(defaults=params, batch=True, parallel=2)) as running:
        with ThreadPoolExecutor(2) as pool:
            batched = list(pool.map(lambda p: ask(running, p), prompts))
    with start(lm, ServerConfig(defaults=params, speculative=SpeculativeConfig(lm, 4))) as running:
        speculative = [ask(running, p) for p in prompts]
    for got in (batched, speculative):
        for ours, theirs in zip(got, plain, strict=True):
            assert [(t, tops) for t, _, tops in ours] == [(t, tops) for t, _, tops in theirs] and ours
            assert [lp for _, lp, _ in ours] == pytest.approx([lp for _, lp, _ in theirs], abs=1e-4)


# -- n > 1 ------------------------------------------------------------------------------------------
def test_n_choices_are_seeded_forks_of_one_prefilled_prompt(lm):
    params = GenerateParams(max_tokens=8, temperature=1.0)
    messages = [{"role": "system", "content": "Be brief."}, user("Tell me a story.")]
    with start(lm, ServerConfig(defaults=params)) as running:
        c = client(running)
        r = chat(c, messages, n=3, seed=7, logprobs=True)
        chunks = [ch for ch in chat(c, messages, n=3, seed=7, stream=True, stream_options={"include_usage": True})]
        # The client goes on with choice 1: the conversation starts from the pooled prompt's cache.
        picked = r.choices[1].message.content
        later = chat(c, [*messages, {"role": "assistant", "content": picked}, user("And then?")], seed=3)
        bad = post(running, "/chat/completions", {"messages": messages, "n": 0})
    # The ground truth: one in-process session per choice, seeded seed + index.
    sessions = [ChatSession.builder(lm).instructions("Be brief.").generate_params(params.copy(seed=7 + i)).build()
                for i in range(3)]
    expected = [s.respond("Tell me a story.") for s in sessions]
    assert [ch.message.content for ch in r.choices] == expected and len(set(expected)) > 1
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert ["".join(e.token for e in ch.logprobs.content) for ch in r.choices] == expected  # each its own
    assert r.usage.prompt_tokens == sessions[0].last_stats.prompt_tokens  # counted once
    assert r.usage.completion_tokens == sum(s.last_stats.generation_tokens for s in sessions)
    streamed = {}
    for ch in chunks:
        for choice in ch.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == expected
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert later.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens - 8  # the prompt's cache
    sessions[1].generate_params = params.copy(seed=3)
    assert later.choices[0].message.content == sessions[1].respond("And then?")
    assert bad[0] == 400 and bad[1]["error"]["param"] == "n"
    # How a choice after the first is made: a fork of the session that answered, answering again,
    # feeds only the prompt's last token (for its logits) and reuses the rest of the prompt's cache.
    fork = sessions[0].fork()
    fork.regenerate()
    assert fork.last_stats.prefilled_tokens == 1 and fork.last_stats.reused_tokens == r.usage.prompt_tokens - 1


def test_every_choice_of_n_is_counted_in_metrics(lm):
    def completion_tokens(running):
        text = httpx.get(running.url.removesuffix("/v1") + "/metrics", timeout=60).text
        (line,) = [row for row in text.splitlines() if row.startswith("chatkit_completion_tokens_total")]
        return float(line.split()[-1])

    with start(lm, ServerConfig(defaults=GenerateParams(max_tokens=5, temperature=1.0))) as running:
        before = completion_tokens(running)
        r = chat(client(running), [user("Hi")], n=3, seed=7)
        assert completion_tokens(running) - before == r.usage.completion_tokens > 5
