"""strict_tools: tool calls constrained to the tools' schemas (chatkit.guided.call_grammar).

Random-weight models write garbage. A scripted processor opens a tool call (forces the format's start
marker, as a model that decided to call a tool would) and then lets the model go on: with strict_tools
the call parses and fits its tool's schema every time; without, it does not, and the error goes back to
the model as the tool's result."""

import dataclasses
import json

from chatkit import ChatMessage, ChatSession, GenerateParams, Role, SpeculativeConfig, ToolCall
from chatkit.errors import ChatKitError, InvalidOutputSpecError, InvalidParamsError
from chatkit.guided import ToolCallConstraint, tool_call_grammar
from chatkit.text.reply import Segmenter
from chatkit.tools import Tool, check_arguments

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_ledger_matches_cache, fresh_reply
from mlx_lm.generate import generate_step

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10, "description": "The city."},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    }, "required": ["city"]},
}}
TIME = {"type": "function", "function": {
    "name": "local_time", "description": "The local time of a city, some days ahead.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 0, "maximum": 7},
    }, "required": ["city", "days"]},
}}
SCHEMAS = [WEATHER, TIME]


def weather(city, unit="celsius"):
    return f"sunny in {city!r} ({unit})"


def local_time(city, days):
    return f"12:00 in {city!r}, {days} days ahead"


TOOLS = [Tool(WEATHER, weather), Tool(TIME, local_time)]
PROMPTS = ("What is the weather in Paris?", "And the time in Oslo, in two days?", "Tell me everything!")


def force(logits, token):
    return mx.where(mx.arange(logits.shape[-1]) == token, logits, -mx.inf)


class ForceAt:
    """Forces ``text``'s tokens from reply position ``at`` on (free before and after): a pure function
    of the tokens shown, given the prompt's length (so it also serves speculative decoding)."""

    def __init__(self, tokenizer, text, *, prompt_length, at=0):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.n, self.at = prompt_length, at

    def __call__(self, tokens, logits):
        i = tokens.size - self.n - self.at
        return force(logits, self.ids[i]) if 0 <= i < len(self.ids) else logits


class OpenCall:
    """A scripted model's decisions, its words left to the model: in the ``turn``-th assistant reply of
    a conversation (ChatML: counted by the ``<|im_start|>assistant\\n`` openings in the tokens shown) it
    writes ``text`` first (which opens a call), closes the call after ``close_after`` tokens if it is
    still open (``None``: never), and ends the turn once the call is closed. A pure function of the
    tokens shown, as a session shows them all (so it also serves speculative decoding)."""

    def __init__(self, tokenizer, text, turn=1, close_after=None):
        self.open = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.turn, self.close_after = turn, close_after
        self.end_call, self.end_turn = tokenizer.tool_call_end_tokens[0], tokenizer.eos_token_id

    def __call__(self, tokens, logits):
        t, g = tokens.tolist(), self.open
        starts = [i + len(g) for i in range(len(t) - len(g) + 1) if t[i : i + len(g)] == g]
        if len(starts) != self.turn:
            return logits
        reply = t[starts[-1]:]
        if len(reply) < len(self.ids):
            return force(logits, self.ids[len(reply)])
        if self.end_turn in reply:
            return logits
        if self.end_call in reply:
            return force(logits, self.end_turn)
        if self.close_after is not None and len(reply) >= len(self.ids) + self.close_after:
            return force(logits, self.end_call)
        return logits


def with_json_tools(lm):
    """``lm`` with mlx-lm's Qwen / Hermes tool format on its tokenizer: on the spm and gemma test
    tokenizers ``<tool_call>`` is then plain text of several tokens (as on Hermes-3's Llama vocabulary)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.tool_parsers import json_tools

    old = lm.tokenizer
    tok = TokenizerWrapper(old._tokenizer, eos_token_ids=old.eos_token_ids, tool_call_start=json_tools.tool_call_start,
                           tool_call_end=json_tools.tool_call_end, tool_parser=json_tools.parse_tool_call)
    tok._detokenizer = old._detokenizer  # the family's streaming detokenizer
    return dataclasses.replace(lm, tokenizer=tok)


@pytest.fixture(scope="module")
def models():
    from chatkit.testing import tiny_model

    cache = {}

    def get(tokenizer, seed=0):
        if (tokenizer, seed) not in cache:
            if tokenizer in ("spm", "gemma"):
                cache[tokenizer, seed] = with_json_tools(tiny_model(arch="qwen3", tokenizer=tokenizer, seed=seed))
            else:
                cache[tokenizer, seed] = tiny_model(arch="qwen3", tokenizer=tokenizer, seed=seed)
        return cache[tokenizer, seed]

    return get


def generate(lm, prompt, processors, max_tokens=150):
    """Greedy reply tokens (the end token included, when reached) under ``processors``."""
    eos = lm.tokenizer.eos_token_ids
    out = []
    for token, _ in generate_step(mx.array(prompt), lm.model, max_tokens=max_tokens, logits_processors=processors):
        out.append(int(token))
        if token in eos:
            break
    return out


def calls_of(lm, prompt, tokens):
    """The reply's tool calls, read as a session reads them (chatkit.text.reply over the decoded text)."""
    tok = lm.tokenizer
    seg = Segmenter(tok, prompt=prompt, tools=SCHEMAS)
    seg.feed(tok.decode([t for t in tokens if t not in tok.eos_token_ids]), final=True)
    return seg.tool_calls


def valid(call):
    tool = next((t for t in SCHEMAS if t["function"]["name"] == call.name), None)
    return call.error is None and tool is not None and check_arguments(tool, call.arguments) is None


# -- the constraint on its own (mlx-lm's generate_step) -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", ["bpe-think", "spm", "gemma"])
def test_a_strict_call_parses_and_fits_its_schema_every_time_and_an_unconstrained_one_does_not(models, tokenizer):
    strict_valid, free_valid = [], []
    for seed in (0, 1):
        lm = models(tokenizer, seed)
        grammar = tool_call_grammar(lm.tokenizer, SCHEMAS)
        for text in PROMPTS:
            prompt = lm.tokenizer.encode(text)
            opener = ForceAt(lm.tokenizer, "Let me check.<tool_call>", prompt_length=len(prompt))
            strict = ToolCallConstraint(grammar, lm.tokenizer, stop=["\n\n\n"])
            tokens = generate(lm, prompt, [opener, strict], max_tokens=150)
            calls = calls_of(lm, prompt, tokens)
            assert calls and strict.calls == len(calls), lm.tokenizer.decode(tokens)
            if strict.in_call:  # max_tokens cut the last call short (the random model keeps calling)
                assert len(tokens) == 150 and tokens[-1] not in lm.tokenizer.eos_token_ids
                calls = calls[:-1]
            strict_valid += [valid(c) for c in calls]
            free_valid += [valid(c) for c in calls_of(lm, prompt, generate(lm, prompt, [opener]))]
    assert all(strict_valid) and len(strict_valid) >= 6
    assert not any(free_valid)  # the same models, unconstrained: no call is valid


def test_text_before_the_call_stays_free_and_the_call_is_constrained(models):
    lm = models("bpe-think")
    prompt = lm.tokenizer.encode(PROMPTS[0])
    opener = ForceAt(lm.tokenizer, "<tool_call>", prompt_length=len(prompt), at=12)
    grammar = tool_call_grammar(lm.tokenizer, SCHEMAS)
    strict = generate(lm, prompt, [opener, ToolCallConstraint(grammar, lm.tokenizer)])
    free = generate(lm, prompt, [opener])
    marker = lm.tokenizer.tool_call_start_tokens[0]
    assert strict[12] == free[12] == marker
    assert strict[:12] == free[:12]  # the model's own (unmasked) text before the call
    assert strict[13:] != free[13:]
    [call] = calls_of(lm, prompt, strict)
    assert valid(call)
    # As the template writes a call back: "\n", {"name": ..., "arguments": ...} with json.dumps' separators, "\n".
    body = lm.tokenizer.decode(strict[13:strict.index(lm.tokenizer.tool_call_end_tokens[0])])
    assert json.loads(body) == {"name": call.name, "arguments": call.arguments}
    assert body.startswith('\n{"name": "') and '", "arguments": {' in body and body.endswith("}}\n")


def test_marker_text_cannot_open_a_call_mid_token_nor_end_one_inside_a_string(models):
    """chatkit reads calls from the text: a start marker spelled in pieces opens a constrained call, and
    the end marker's text (or a stop string) cannot appear inside a JSON string (it would cut the call short)."""
    lm = models("bpe-think")
    tok = lm.tokenizer
    note = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    grammar = tool_call_grammar(tok, [note])
    pieces = [tok.encode(p, add_special_tokens=False) for p in ("<tool", "_call", ">")]
    assert all(len(p) >= 1 for p in pieces) and tok.tool_call_start_tokens[0] not in sum(pieces, [])
    c = ToolCallConstraint(grammar, tok)
    for t in sum(pieces, []):
        c.advance(t)
    assert c.in_call  # the text "<tool_call>" opened a call, also without the marker token
    for t in tok.encode('\n{"name": "note", "arguments": {"text": "', add_special_tokens=False):
        c.advance(t)
    for t in tok.encode("</tool_call", add_special_tokens=False):
        assert c.allowed(lm.model.args.vocab_size)[t]
        c.advance(t)
    closing = tok.encode(">", add_special_tokens=False)[0]
    allowed = c.allowed(lm.model.args.vocab_size)
    assert not allowed[closing] and allowed.sum() > 100  # any other character of the text
    # A token the grammar refuses (the source did not apply the mask) raises and changes nothing.
    with pytest.raises(ChatKitError, match="grammar"):
        c.advance(tok.eos_token_id)
    assert c.in_call and c.allowed(lm.model.args.vocab_size).sum() == allowed.sum()
    # Stop strings end a reply in any state: one the model can avoid is kept out of the call; one the
    # grammar's own text holds (stop="\n": the newline after <tool_call>) is left to end the reply.
    marker, newline = tok.tool_call_start_tokens[0], tok.encode("\n", add_special_tokens=False)[0]
    vocab = lm.model.args.vocab_size
    s = ToolCallConstraint(grammar, tok, stop=["zq"])
    for t in [marker, *tok.encode('\n{"name": "note", "arguments": {"text": "z', add_special_tokens=False)]:
        s.advance(t)
    q = [t for t in range(vocab) if tok.decode([t]).startswith("q")]
    allowed = s.allowed(vocab)
    assert len(q) > 5 and not allowed[q].any() and allowed.sum() > 100
    s = ToolCallConstraint(grammar, tok, stop=["\n"])
    s.advance(marker)
    assert s.allowed(vocab)[newline]
    # Free text may not write the marker with more text in the same token (the call's first bytes
    # would escape the grammar): find such a token in the vocabulary and check it is refused.
    free = ToolCallConstraint(grammar, tok)
    for t in tok.encode("Hi <tool_call", add_special_tokens=False):
        free.advance(t)
    glued = [i for i in range(vocab) if tok.decode([i]).startswith(">") and tok.decode([i]) != ">"]
    allowed = free.allowed(vocab)
    assert len(glued) > 5 and not allowed[glued].any() and allowed.sum() == vocab - len(glued)
    assert allowed[closing] and not free.in_call
    free.advance(closing)
    assert free.in_call


def test_after_a_call_the_reply_may_only_call_again_or_end(models):
    lm = models("bpe-think")
    tok, vocab = lm.tokenizer, lm.model.args.vocab_size
    c = ToolCallConstraint(tool_call_grammar(tok, SCHEMAS), tok)
    call = '<tool_call>\n{"name": "local_time", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    for t in tok.encode(call, add_special_tokens=False):
        c.advance(t)
    assert not c.in_call and c.calls == 1
    allowed = np.flatnonzero(c.allowed(vocab))
    words = [n * "\n" + "<tool_call>" for n in range(3)]
    assert {tok.tool_call_start_tokens[0], tok.eos_token_id} <= set(allowed.tolist())
    assert all(t in tok.eos_token_ids or any(w.startswith(tok.decode([t])) for w in words) for t in allowed)
    for t in tok.encode("\n<tool_call>", add_special_tokens=False):
        c.advance(t)
    assert c.in_call and c.calls == 2


# -- strict_tools in a session ------------------------------------------------------------------------------


def strict_session(lm, *, opener="Let me check.<tool_call>", close_after=None, max_tokens=120, strict=True, **tool_options):
    script = OpenCall(lm.tokenizer, opener, close_after=close_after)
    params = GenerateParams(max_tokens=max_tokens, logits_processors=[script])
    return ChatSession.builder(lm).tools(TOOLS, strict_tools=strict, **tool_options).generate_params(params).build()


@pytest.mark.slow
def test_the_loop_runs_strict_calls_and_the_next_turn_equals_a_fresh_session(models):
    lm = models("bpe-think")
    session = strict_session(lm)
    with session.stream_respond(PROMPTS[0]) as stream:
        chunks = list(stream)
    user, asked, *results, answer = session.history
    assert asked.tool_calls and all(valid(c) for c in asked.tool_calls)
    assert [r.tool_call_id for r in results] == [c.id for c in asked.tool_calls]
    assert all(not r.content.startswith("Error") for r in results)  # the functions ran on valid arguments
    assert [c.kind for c in chunks if c.kind == "tool_result"] == ["tool_result"] * len(results)
    assert answer.role.value == "assistant" and not answer.tool_calls
    assert_ledger_matches_cache(session)
    # Invariant 2: the next (free) turn equals a fresh session replaying this history.
    expected = fresh_reply(session, "Thanks.", tools=TOOLS)
    with session.stream_respond("Thanks.") as s:
        for _ in s:
            pass
    assert s.tokens == expected


def test_without_strict_tools_the_same_garbage_goes_back_to_the_model_as_an_error(models):
    lm = models("bpe-think")
    session = strict_session(lm, strict=False, close_after=30)
    session.respond(PROMPTS[0])
    user, asked, *results, answer = session.history
    assert asked.tool_calls and not any(valid(c) for c in asked.tool_calls)
    assert results and all(r.content.startswith("Error") for r in results)


def test_strict_tools_per_call_overrides_the_sessions_default(models):
    lm = models("bpe-think")
    loose = strict_session(lm, strict=False, close_after=30)
    loose.respond(PROMPTS[0], strict_tools=True)
    assert all(valid(c) for c in loose.history[1].tool_calls)
    strict = strict_session(lm, close_after=30)
    strict.respond(PROMPTS[0], strict_tools=False)
    assert not any(valid(c) for c in strict.history[1].tool_calls)


def test_manual_mode_returns_strict_calls(models):
    lm = models("bpe-think")
    session = strict_session(lm, tool_execution="manual")
    session.respond(PROMPTS[1])
    pending = session.pending_tool_calls
    assert pending and all(valid(c) for c in pending)
    assert list(session.history[-1].tool_calls) == pending
    session.regenerate()  # the session's default holds for a regenerated reply too
    again = session.pending_tool_calls
    assert again and all(valid(c) for c in again) and len(session.history) == 2


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["agreeing", "disagreeing", "prompt_lookup"])
def test_speculative_strict_turns_equal_standard_ones(models, draft):
    lm = models("bpe-think")
    drafts = {"agreeing": models("bpe-think"), "disagreeing": models("bpe-think", seed=1), "prompt_lookup": draft}
    config = SpeculativeConfig(drafts[draft], num_draft_tokens=3)
    standard = strict_session(lm)
    speculative = ChatSession.builder(lm).tools(TOOLS, strict_tools=True).generate_params(standard.generate_params) \
        .speculative(config).build()
    accepted = 0
    for prompt in PROMPTS[:2]:
        standard.respond(prompt)
        speculative.respond(prompt)
        accepted += speculative.last_stats.draft_tokens_accepted

    def seen(history):  # call ids are random: everything else
        return [(m.role, m.content, m.reasoning, [(c.name, c.arguments, c.error) for c in m.tool_calls]) for m in history]

    assert seen(speculative.history) == seen(standard.history)
    assert len(standard.history) > 4 and all(valid(c) for m in standard.history for c in m.tool_calls)
    assert accepted > 0 or draft != "agreeing"  # the same weights: drafts inside calls were checked and kept


def test_reasoning_stays_free_and_the_call_after_it_is_strict(models):
    lm = models("bpe-think")
    session = strict_session(lm, opener="<think>\nI should call a tool.\n</think>\n\n<tool_call>", tool_execution="manual")
    session.respond(PROMPTS[0])
    asked = session.history[-1]
    assert asked.reasoning == "I should call a tool." and asked.tool_calls and all(valid(c) for c in asked.tool_calls)


def test_async_api_takes_strict_tools(models):
    import asyncio

    lm = models("bpe-think")
    session = strict_session(lm, strict=False, tool_execution="manual")
    asyncio.run(session.arespond(PROMPTS[0], strict_tools=True))
    assert session.pending_tool_calls and all(valid(c) for c in session.pending_tool_calls)


# -- refusals: before anything changes ----------------------------------------------------------------------


def test_a_bad_schema_or_an_unsupported_format_is_refused_before_anything_changes(models):
    lm = models("bpe-think")
    # A valid JSON Schema that llguidance cannot enforce (an invalid one is refused by any builder).
    unenforceable = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    bad = Tool({"type": "function", "function": {"name": "f", "parameters": unenforceable}}, weather)
    with pytest.raises(InvalidOutputSpecError, match="'f'"):
        ChatSession.builder(lm).tools([bad], strict_tools=True)
    session = ChatSession.builder(lm).tools([bad, *TOOLS]).generate_params(GenerateParams(max_tokens=4)).build()
    session.respond("Hi")
    before = session.history
    with pytest.raises(InvalidOutputSpecError, match="'f'"):
        session.respond(PROMPTS[0], strict_tools=True)
    assert session.history == before and not session.busy
    # A tool result that answers one of two pending calls is added without a turn: not when refused.
    calls = (ToolCall("a1b2c3d4e", "get_weather", {"city": "Oslo"}), ToolCall("f1g2h3i4j", "get_weather", {"city": "Rome"}))
    history = [ChatMessage.user("Weather?"), ChatMessage.assistant("", tool_calls=calls)]
    waiting = ChatSession.builder(lm).tools([bad, *TOOLS], tool_execution="manual").history(history).build()
    with pytest.raises(InvalidOutputSpecError, match="'f'"):
        waiting.respond("sunny", role=Role.TOOL, tool_call_id="a1b2c3d4e", strict_tools=True)
    assert waiting.history == history and len(waiting.pending_tool_calls) == 2
    strict = strict_session(lm)
    with pytest.raises(InvalidOutputSpecError):
        strict.tools = [bad]
    assert [t["function"]["name"] for t in strict.tools] == ["get_weather", "local_time"]
    with pytest.raises(InvalidOutputSpecError, match="output="):
        strict.respond(PROMPTS[0], output=int, strict_tools=True)
    with pytest.raises(InvalidParamsError, match="no tools"):
        ChatSession.builder(lm).build().respond("Hi", strict_tools=True)
    with pytest.raises(InvalidParamsError):
        strict.respond("Hi", strict_tools="yes")
    assert strict.history == [] and not strict.busy
    # A tokenizer without a tool-call format chatkit knows (the plain spm test tokenizer).
    from chatkit.testing import tiny_model

    with pytest.raises(InvalidOutputSpecError, match="tool-call format"):
        ChatSession.builder(tiny_model(arch="qwen3", tokenizer="spm")).tools(TOOLS, strict_tools=True)


def test_formats_whose_calls_are_not_json_are_refused():
    from types import SimpleNamespace

    from chatkit.guided.call_grammar import call_shape

    harmony = SimpleNamespace(has_tool_calling=False, get_vocab=lambda: {s: i for i, s in enumerate(
        ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>"])})
    with pytest.raises(InvalidOutputSpecError, match="harmony"):
        call_shape(harmony)
    pythonic = SimpleNamespace(has_tool_calling=True, tool_parser=type("P", (), {"__module__": "mlx_lm.tool_parsers.pythonic"})(),
                               tool_call_start="<|tool_call_start|>", tool_call_end="<|tool_call_end|>")
    with pytest.raises(InvalidOutputSpecError, match="pythonic"):
        call_shape(pythonic)


# -- the other JSON formats (chatkit/text/formats/): a random walk over the mask -------------------------------


FAMILIES = {
    "llama3": (["<|python_tag|>", "<|eom_id|>"], "<|python_tag|>"),
    "granite": (["<|tool_call|>", "<|start_of_role|>"], "<|tool_call|>"),
    "command_r": (["<|START_ACTION|>", "<|END_ACTION|>"], "<|START_ACTION|>"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_json_formats_give_valid_calls_from_random_choices(models, family):
    """A tokenizer with the family's special tokens; tokens drawn uniformly among those the mask allows
    (garbage of the worst kind): the segmenter reads valid calls every time."""
    import copy

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    specials, marker = FAMILIES[family]
    hf = copy.deepcopy(models("bpe").tokenizer._tokenizer)
    hf.add_special_tokens({"additional_special_tokens": specials})
    eos = [hf.convert_tokens_to_ids("<|im_end|>")] + ([hf.convert_tokens_to_ids("<|eom_id|>")] if family == "llama3" else [])
    tok = TokenizerWrapper(hf, eos_token_ids=eos)
    grammar = tool_call_grammar(tok, SCHEMAS)
    assert grammar.format == family
    for calls in random_calls(tok, grammar, "Sure." + marker, eos, len(hf)):
        assert calls and all(valid(call) for call in calls)


def random_calls(tok, grammar, opening, eos, vocab, schemas=SCHEMAS, replies=5):
    """Replies that write ``opening`` and then draw each token uniformly among those the mask allows
    (ending the reply once the call is over); their tool calls as the segmenter reads them."""
    rng = np.random.default_rng(0)
    for _ in range(replies):
        c = ToolCallConstraint(grammar, tok)
        tokens = tok.encode(opening, add_special_tokens=False)
        for t in tokens:
            c.advance(t)
        while c.in_call or tokens[-1] not in eos and len(tokens) < 400:
            allowed = c.allowed(vocab)
            if not c.in_call:  # the call is over: end the reply
                choice = eos[0]
            else:
                choice = int(rng.choice(np.flatnonzero(allowed)))
            c.advance(choice)
            tokens.append(choice)
        seg = Segmenter(tok, tools=schemas)
        seg.feed(tok.decode([t for t in tokens if t not in eos]), final=True)
        yield seg.tool_calls


def test_parameters_with_definitions_are_embedded_with_their_refs(models):
    """A tool whose parameters use $defs (as pydantic writes them): the definitions move to the call's
    root and its refs follow them; a ref that leaves the schema is refused."""
    item = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 6},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}
    order = {"type": "function", "function": {"name": "order", "parameters": {
        "type": "object", "$defs": {"Item": item},
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1, "maxItems": 2}},
        "required": ["items"]}}}
    lm = models("bpe-think")
    tok = lm.tokenizer
    grammar = tool_call_grammar(tok, [WEATHER, order])
    seen = []
    for calls in random_calls(tok, grammar, "<tool_call>", [tok.eos_token_id], lm.model.args.vocab_size,
                              schemas=[WEATHER, order], replies=8):
        assert calls and all(c.error is None for c in calls)
        for c in calls:
            schema = WEATHER if c.name == "get_weather" else order
            assert check_arguments(schema, c.arguments) is None
            seen.append(c.name)
    assert "order" in seen
    elsewhere = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "other.json#/X"}}}}}
    with pytest.raises(InvalidOutputSpecError, match="'f'"):
        tool_call_grammar(tok, [elsewhere])


def test_a_required_constraint_opens_with_a_call_and_a_single_one_ends_after_it(tiny):
    """OpenAI's tool_choice="required" and parallel_tool_calls=false (``chatkit serve``): the reply may
    only open a call (never end first), and with ``single`` it ends after its first call."""
    tokenizer = tiny("qwen3", "bpe-think", 0).tokenizer
    vocab = len(tokenizer.get_vocab())
    eos = tokenizer.eos_token_id
    (start,) = tokenizer.encode("<tool_call>", add_special_tokens=False)
    call = tokenizer.encode('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                            add_special_tokens=False)
    for single in (False, True):
        held = ToolCallConstraint(tool_call_grammar(tokenizer, SCHEMAS, single=single), tokenizer, required=True)
        allowed = held.allowed(vocab)
        assert allowed is not None and allowed[start] and not allowed[eos] and not allowed[tokenizer.encode("Hi")[0]]
        with pytest.raises(ChatKitError, match="must call"):
            ToolCallConstraint(tool_call_grammar(tokenizer, SCHEMAS), tokenizer, required=True).advance(eos)
        for t in [start, *call]:
            held.advance(t)
        after = held.allowed(vocab)
        assert after is not None and after[eos] and after[start] != single
    free = ToolCallConstraint(tool_call_grammar(tokenizer, SCHEMAS), tokenizer)
    assert free.allowed(vocab) is None  # without required, free text costs nothing
