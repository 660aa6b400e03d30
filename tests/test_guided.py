"""Guided generation at the room level: specs, the constraint under mlx-lm's generate_step and
speculative_generate_step, on random-weight tiny models (garbage when unconstrained)."""

import dataclasses
import enum
import json
import re
from typing import Annotated, Literal, TypedDict

from chatkit.errors import ChatKitError, IncompleteOutputError, InvalidOutputSpecError, OutputValidationError
from chatkit.guided import (
    Constraint,
    instructions,
    llg_tokenizer,
    matches,
    output_spec,
    partial_json,
    response_format,
    strict_schema,
)

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache
from pydantic import BaseModel, ConfigDict, Field

TOKENIZERS = ("bpe", "spm", "gemma")
PROMPTS = ("My name is Ada and I live in Oslo.", "Tell me about the weather, please!")


# -- the value types ------------------------------------------------------------------------------

Short = Annotated[str, Field(min_length=1, max_length=12)]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Address(BaseModel):
    city: Short
    zip: Annotated[int, Field(ge=1000, le=9999)]


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]
    address: Address
    nickname: Short | None = None


class Item(BaseModel):
    label: Short
    color: Color
    size: Literal["S", "M", "L"]


class Order(BaseModel):
    items: Annotated[list[Item], Field(min_length=1, max_length=3)]
    rush: bool
    notes: Short | None = None


@dataclasses.dataclass
class Point:
    x: Annotated[int, Field(ge=-50, le=50)]
    y: Annotated[int, Field(ge=-50, le=50)]


class Todo(TypedDict):
    title: Short
    done: bool


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 1, "maximum": 5},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
    "required": ["answer", "confidence"],
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
LARK = r"""
start: greeting " " NAME "!"
greeting: "hello" | "hi" | "good " ("morning" | "evening")
NAME: /[A-Z][a-z]{1,8}/
"""
LARK_RE = re.compile(r"(hello|hi|good (morning|evening)) [A-Z][a-z]{1,8}!")


def check_person(p):
    assert isinstance(p, Person) and isinstance(p.address, Address)
    assert 0 <= p.age <= 120 and 1000 <= p.address.zip <= 9999 and 1 <= len(p.name) <= 12
    return True


def check_order(o):
    assert isinstance(o, Order) and 1 <= len(o.items) <= 3
    assert all(isinstance(i.color, Color) and i.size in "SML" for i in o.items)
    return True


def check_schema(v):
    assert set(v) <= {"answer", "confidence", "reasons"} and v["answer"] in ("yes", "no", "maybe")
    assert 1 <= v["confidence"] <= 5 and len(v.get("reasons", [])) <= 2
    return True


# name -> (spec keywords, a check of the value independent of the spec's own validation)
CASES = {
    "nested": ({"output": Person}, check_person),
    "array-enum": ({"output": Order}, check_order),
    "list": ({"output": Annotated[list[Point], Field(max_length=3)]},
             lambda v: all(isinstance(p, Point) and -50 <= p.x <= 50 for p in v) and len(v) <= 3),
    "typeddict": ({"output": Todo}, lambda v: set(v) == {"title", "done"} and isinstance(v["done"], bool)),
    "literal": ({"output": Literal["yes", "no"]}, lambda v: v in ("yes", "no")),
    "enum": ({"output": Color}, lambda v: isinstance(v, Color)),
    "int-range": ({"output": Annotated[int, Field(ge=-5, le=300)]}, lambda v: type(v) is int and -5 <= v <= 300),
    "bool": ({"output": bool}, lambda v: type(v) is bool),
    "schema": ({"output": SCHEMA}, check_schema),
    "regex": ({"regex": DATE}, lambda v: re.fullmatch(DATE, v)),
    "lark": ({"grammar": LARK}, lambda v: LARK_RE.fullmatch(v)),
}


def generate(lm, constraint, prompt, *, max_tokens=120, draft=None, num_draft=3):
    """Greedy tokens of the reply (the end token included, when reached)."""
    ids = mx.array(lm.tokenizer.encode(prompt))
    eos = lm.tokenizer.eos_token_ids
    processors = [constraint] if constraint is not None else None
    if draft is None:
        steps = ((t, lp) for t, lp in generate_step(ids, lm.model, max_tokens=max_tokens, logits_processors=processors))
    else:
        cache = make_prompt_cache(lm.model) + make_prompt_cache(draft.model)
        steps = ((t, lp) for t, lp, _ in speculative_generate_step(
            ids, lm.model, draft.model, prompt_cache=cache, max_tokens=max_tokens,
            num_draft_tokens=num_draft, logits_processors=processors))
    out = []
    for token, _ in steps:
        out.append(token)
        if token in eos:
            break
    return out


def reply_text(lm, tokens):
    """The reply as the session would commit it: the tokens' text through the model's tokenizer."""
    return lm.tokenizer.decode([t for t in tokens if t not in lm.tokenizer.eos_token_ids])


# -- guided replies on random models ---------------------------------------------------------------


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_guided_reply_is_valid(tiny, tokenizer, case):
    lm = tiny("qwen3", tokenizer)
    keywords, check = CASES[case]
    spec = output_spec(**keywords)
    for prompt in PROMPTS:
        c = Constraint(spec, lm.tokenizer)
        tokens = generate(lm, c, prompt)
        assert tokens[-1] in lm.tokenizer.eos_token_ids, f"no end in {len(tokens)} tokens: {c.text!r}"
        value = c.finish(tokens)
        assert check(value), value
        # Invariant 6: the committed text (the tokens' own text) is the value, by an independent parse.
        text = reply_text(lm, tokens)
        assert text == c.text
        if spec.kind != "json":
            assert value == text
        elif spec.adapter is not None:
            assert spec.adapter.validate_json(text) == value
        else:
            assert json.loads(text) == value


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_unguided_replies_of_the_same_models_are_not_valid(tiny, tokenizer):
    """The models are garbage without the constraint, so the test above can fail."""
    lm = tiny("qwen3", tokenizer)
    for prompt in PROMPTS:
        text = reply_text(lm, generate(lm, None, prompt, max_tokens=40))
        with pytest.raises(ValueError):
            Person.model_validate_json(text)
        assert not re.fullmatch(DATE, text)


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("case", ["nested", "array-enum", "schema", "lark"])
@pytest.mark.parametrize("num_draft", [2, 4])
def test_speculative_guided_equals_standard_guided(tiny, tokenizer, case, num_draft):
    lm, draft = tiny("qwen3", tokenizer), tiny("qwen3", tokenizer, seed=1)
    spec = output_spec(**CASES[case][0])
    for prompt in PROMPTS:
        standard = generate(lm, Constraint(spec, lm.tokenizer), prompt)
        c = Constraint(spec, lm.tokenizer)
        speculative = generate(lm, c, prompt, draft=draft, num_draft=num_draft)
        assert speculative == standard
        assert CASES[case][1](c.finish(speculative))


def test_speculative_with_an_agreeing_draft_accepts_and_stays_equal(tiny):
    """The draft is the target itself: every draft token is accepted, whole runs past the value's
    end included (the case where the processor is shown end tokens and then rolled back)."""
    lm = tiny("qwen3", "spm")
    spec = output_spec(Person)
    for prompt in PROMPTS:
        standard = generate(lm, Constraint(spec, lm.tokenizer), prompt)
        assert generate(lm, Constraint(spec, lm.tokenizer), prompt, draft=lm, num_draft=4) == standard


def test_overlapped_mask_gives_the_same_tokens(tiny):
    lm = tiny("qwen3", "bpe")
    spec = output_spec(Order)
    a = generate(lm, Constraint(spec, lm.tokenizer, overlap=True), PROMPTS[0])
    b = generate(lm, Constraint(spec, lm.tokenizer, overlap=False), PROMPTS[0])
    assert a == b


def test_every_step_is_masked_including_the_first(tiny):
    """Under generate_step, the processor is called once per generated token, the first after
    prefill included, and each token lies in the mask computed for it."""
    lm = tiny("qwen3", "bpe")
    spec = output_spec(Person)
    c = Constraint(spec, lm.tokenizer)
    masks = []

    def record(tokens, logits):
        out = c(tokens, logits)
        masks.append(out[0] > -mx.inf)
        return out

    ids = mx.array(lm.tokenizer.encode(PROMPTS[0]))
    tokens = []
    for token, _ in generate_step(ids, lm.model, max_tokens=80, logits_processors=[record]):
        tokens.append(token)
        assert masks[len(tokens) - 1][token].item(), f"token {len(tokens)} outside its mask"
        if token in lm.tokenizer.eos_token_ids:
            break
    assert tokens[-1] in lm.tokenizer.eos_token_ids
    assert int(mx.sum(masks[0]).item()) < 20, "the first step after prefill is masked (a JSON object opens)"
    assert not any(masks[i][t].item() for i in range(len(tokens) - 1) for t in lm.tokenizer.eos_token_ids), \
        "the end is allowed only once the value is complete"


# -- reasoning --------------------------------------------------------------------------------------


def test_reasoning_stays_free_and_the_answer_is_constrained(tiny):
    lm = tiny("qwen3", "bpe-think")
    tok = lm.tokenizer
    marker = tok.encode("</think>", add_special_tokens=False)
    assert len(marker) == 1
    spec = output_spec(Person)
    c = Constraint(spec, tok, think_end="</think>")
    free_steps = 6

    ids = mx.array(tok.encode(PROMPTS[0]))

    def think_then_answer(tokens, logits):  # runs before the constraint: close the reasoning at step 6
        if tokens.size - ids.size == free_steps - 1:
            return mx.where(mx.arange(logits.shape[-1]) == marker[0], logits, -mx.inf)
        return logits

    masks, tokens = [], []

    def constrained(tokens_so_far, logits):
        out = c(tokens_so_far, logits)
        masks.append(int(mx.sum(out[0] > -mx.inf).item()))
        return out

    for token, _ in generate_step(ids, lm.model, max_tokens=120, logits_processors=[think_then_answer, constrained]):
        tokens.append(token)
        if token in tok.eos_token_ids:
            break
    assert tokens[free_steps - 1] == marker[0]
    # Reasoning: every token but the ends allowed. Answer: a handful.
    assert masks[: free_steps - 1] == [lm.model.args.vocab_size - len(tok.eos_token_ids)] * (free_steps - 1)
    assert masks[free_steps] < 20, "the first answer token is masked (a JSON object opens)"
    reasoning = tok.decode(tokens[: free_steps - 1])
    with pytest.raises(ValueError):
        json.loads(reasoning)
    check_person(c.finish(tokens))
    assert c.text == reply_text(lm, tokens[free_steps:])


def test_think_end_as_token_ids_and_rollback_into_the_reasoning(tiny):
    lm = tiny("qwen3", "bpe-think")
    tok = lm.tokenizer
    marker = tok.encode("</think>", add_special_tokens=False)
    c = Constraint(output_spec(Literal["yes", "no"]), tok, think_end=marker)
    garbage = tok.encode("not json {{ at all", add_special_tokens=False)
    c.sync(garbage + marker + tok.encode('"yes"', add_special_tokens=False))
    assert c.is_accepting() and c.finish() == "yes"
    c.rollback(len(c.tokens) - len(garbage))  # back inside the reasoning
    assert c.in_reasoning and c.text == "" and not c.is_accepting()
    with pytest.raises(IncompleteOutputError):
        c.finish()
    c.sync(garbage + marker + tok.encode('"no"', add_special_tokens=False))
    assert c.finish() == "no"


# -- incomplete values, bounds, errors ---------------------------------------------------------------


def test_max_tokens_before_the_value_is_complete_raises_with_the_partial_text(tiny):
    lm = tiny("qwen3", "spm")
    spec = output_spec(Person)
    full = generate(lm, Constraint(spec, lm.tokenizer), PROMPTS[0])
    c = Constraint(spec, lm.tokenizer)
    tokens = generate(lm, c, PROMPTS[0], max_tokens=len(full) // 2)
    assert tokens == full[: len(full) // 2]
    with pytest.raises(IncompleteOutputError) as err:
        c.finish(tokens)
    assert err.value.text == reply_text(lm, tokens) and err.value.text
    assert err.value.partial == partial_json(err.value.text)
    assert "max_tokens" in str(err.value)


def test_min_items_beyond_max_tokens_ends_with_an_error_not_a_hang(tiny):
    lm = tiny("qwen3", "bpe")
    spec = output_spec({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 500})
    c = Constraint(spec, lm.tokenizer)
    tokens = generate(lm, c, PROMPTS[0], max_tokens=40)
    assert len(tokens) == 40 and not set(tokens) & lm.tokenizer.eos_token_ids  # the end is never allowed
    with pytest.raises(IncompleteOutputError):
        c.finish(tokens)


@pytest.mark.parametrize("keywords, message", [
    ({"output": {"type": "objekt"}}, "does not compile"),
    ({"output": {"type": "integer", "minimum": 5, "maximum": 3}}, "does not compile"),
    ({"output": {"type": "string", "format": "binary"}}, "Unknown format"),
    ({"output": set[int]}, "Unimplemented keys"),  # uniqueItems: the grammar could not enforce it
    ({"output": {"x": {1, 2}}}, "not JSON data"),
    ({"output": lambda x: x}, "not a type"),
    ({"output": 3}, "not a type"),
    ({"output": "Person"}, "is a string"),
    ({"output": type}, "No JSON Schema"),
    ({"regex": "a(b"}, "does not compile"),
    ({"regex": ""}, "only the empty string"),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "accepts nothing"),
    ({"grammar": "start: foo"}, "does not compile"),
    ({"grammar": 'start: ""'}, "only the empty string"),
    ({"grammar": 42}, "must be Lark grammar text"),
    ({}, "exactly one"),
    ({"output": int, "regex": "[0-9]+"}, "exactly one"),
])
def test_bad_specs_raise_before_anything_runs(keywords, message):
    with pytest.raises(InvalidOutputSpecError, match=message) as err:
        output_spec(**keywords)
    assert isinstance(err.value, ChatKitError)


def test_a_typing_typeddict_works_before_python_3_12():
    import typing

    class T(typing.TypedDict, total=False):
        a: int

    class U(typing.TypedDict):
        a: int
        b: typing.NotRequired[str]

    assert output_spec(output=T).schema.get("required", []) == []
    assert output_spec(output=U).schema["required"] == ["a"]
    assert output_spec(output=U).parse('{"a":1}') == {"a": 1}


def test_type_validators_beyond_the_schema_raise_output_validation_error():
    from pydantic import field_validator

    class Even(BaseModel):
        n: int

        @field_validator("n")
        @classmethod
        def even(cls, v):
            if v % 2:
                raise ValueError("must be even")
            return v

    spec = output_spec(Even)
    assert spec.parse('{"n":4}') == Even(n=4)
    with pytest.raises(OutputValidationError, match="must be even") as err:
        spec.parse('{"n":3}', complete=True)
    assert err.value.text == '{"n":3}'


# -- strictness and the compiled grammar ------------------------------------------------------------


def test_schemas_are_strict_and_json_compact():
    spec = output_spec(Person)
    assert spec.schema["additionalProperties"] is False
    assert spec.schema["$defs"]["Address"]["additionalProperties"] is False
    assert matches(spec, '{"name":"Ada","age":36,"address":{"city":"Oslo","zip":1234}}')
    assert not matches(spec, '{"name": "Ada","age":36,"address":{"city":"Oslo","zip":1234}}')  # a space
    assert not matches(spec, '{"name":"Ada","age":36,"address":{"city":"Oslo","zip":1234},"x":1}')  # extra key
    assert not matches(spec, '{"name":"Ada","age":360,"address":{"city":"Oslo","zip":1234}}')  # range


def test_a_schema_that_says_otherwise_stays_open():
    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        x: int

    spec = output_spec(Open)
    assert spec.schema["additionalProperties"] is True
    assert matches(spec, '{"x":1,"y":2}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert strict_schema(schema) == schema
    assert strict_schema({"type": "object"}) == {"type": "object"}  # declares no properties: left open
    # A property named "properties" is a name, not a keyword.
    nested = {"type": "object", "properties": {"properties": {"type": "object", "properties": {}}}}
    assert strict_schema(nested) == {
        "type": "object", "additionalProperties": False,
        "properties": {"properties": {"type": "object", "properties": {}, "additionalProperties": False}},
    }
    whitespace = output_spec({"type": "array", "items": {"type": "integer"},
                              "x-guidance": {"whitespace_flexible": True}})
    assert matches(whitespace, "[1, 2]")


def test_describe_the_spec_to_the_model():
    spec = output_spec(Person)
    text = instructions(spec)
    assert json.loads(text.split("\n", 1)[1]) == spec.schema
    fmt = response_format(spec)
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["name"] == "Person" and fmt["json_schema"]["schema"] == spec.schema
    assert response_format(output_spec(regex=DATE)) is None and DATE in instructions(output_spec(regex=DATE))
    assert "start" in instructions(output_spec(grammar=LARK))


# -- the constraint's plain interface ---------------------------------------------------------------


def test_tokenizer_view_is_built_once_per_tokenizer(tiny):
    lm = tiny("qwen3", "bpe")
    spec = output_spec(bool)
    assert Constraint(spec, lm.tokenizer)._llt is Constraint(output_spec(int), lm.tokenizer)._llt
    assert llg_tokenizer(lm.tokenizer) is llg_tokenizer(lm.tokenizer)
    assert llg_tokenizer(tiny("qwen3", "spm").tokenizer) is not llg_tokenizer(lm.tokenizer)
    hf = lm.tokenizer._tokenizer  # a Hugging Face tokenizer works too (regression: it was unwrapped once more)
    assert llg_tokenizer(hf).vocab_size == llg_tokenizer(lm.tokenizer).vocab_size
    assert Constraint(spec, hf).finish(hf.encode("true", add_special_tokens=False)) is True


def test_end_tokens_roll_back_exactly(tiny):
    """Regression: llguidance miscounts an end token taken after its grammar stopped, so rolling back
    two ends also undid the value's last token (speculative runs diverged from standard ones)."""
    lm = tiny("qwen3", "bpe")
    tok = lm.tokenizer
    c = Constraint(output_spec(Literal["yes", "no"]), tok)
    value = tok.encode('"yes"', add_special_tokens=False)
    end = sorted(tok.eos_token_ids)[0]
    c.sync(value + [end, end])
    assert c.done and c.finish() == "yes"
    c.rollback(2)
    assert c.tokens == value and c.is_accepting() and c.forced_end()
    mask = c.allowed(lm.model.args.vocab_size)
    assert mask.nonzero()[0].tolist() == sorted(tok.eos_token_ids)


def test_interface_mask_advance_accepting_forced_end(tiny):
    lm = tiny("qwen3", "gemma")
    tok = lm.tokenizer
    c = Constraint(output_spec(Literal["yes", "no"]), tok)
    vocab = lm.model.args.vocab_size
    logits = mx.zeros((1, vocab))
    assert not c.is_accepting() and not c.done and not c.forced_end()
    while not c.forced_end():
        masked = c.mask_logits(logits)
        assert masked.shape == logits.shape
        allowed = mx.argmax(masked, axis=-1).item()
        c.advance(allowed)
    assert c.is_accepting() and c.finish() in ("yes", "no")
    wide = c.allowed(vocab + 40)  # logits wider than the tokenizer: the padding is never allowed
    assert not wide[-40:].any() and wide[:vocab].any()


def test_a_refused_token_raises_and_leaves_the_constraint_usable(tiny):
    lm = tiny("qwen3", "bpe")
    tok = lm.tokenizer
    c = Constraint(output_spec(Point), tok)
    c.sync(tok.encode('{"x":', add_special_tokens=False))
    bad = tok.encode("A", add_special_tokens=False)[0]
    with pytest.raises(ChatKitError, match="breaks"):
        c.advance(bad)
    with pytest.raises(ChatKitError, match="end before"):
        c.advance(sorted(tok.eos_token_ids)[0])
    for t in tok.encode('3,"y":-4}', add_special_tokens=False):
        c.advance(t)
    assert c.finish() == Point(3, -4)


def test_check_draft_counts_the_grammar_valid_prefix(tiny):
    lm = tiny("qwen3", "bpe")
    tok = lm.tokenizer
    c = Constraint(output_spec(Point), tok)
    good = tok.encode('{"x":1', add_special_tokens=False)
    bad = tok.encode("Z", add_special_tokens=False)
    assert c.check_draft(good + bad + good) == len(good)
    assert c.tokens == []  # the state is as it was
    think = Constraint(output_spec(Point), tok, think_end="</think>")
    marker = tok.encode("</think>", add_special_tokens=False)
    assert think.check_draft(bad + marker + good + bad) == 1 + len(marker) + len(good)
    assert think.in_reasoning and think.tokens == []


# -- partial objects ----------------------------------------------------------------------------------


def test_partial_json_keeps_only_complete_parts():
    assert partial_json("") is None and partial_json("12") is None
    assert partial_json('{"name":"Ad') == {}
    assert partial_json('{"name":"Ada","age":3') == {"name": "Ada"}
    assert partial_json('{"name":"Ada","age":36,') == {"name": "Ada", "age": 36}
    assert partial_json('{"ok":true') == {"ok": True} and partial_json('{"ok":fals') == {}
    assert partial_json('{"a":{"b":"c","d":-1.5e') == {"a": {"b": "c"}}
    assert partial_json('[1,2') == [1] and partial_json('{"s":"x 12') == {}


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_streamed_partial_objects_grow_to_the_final_value(tiny, tokenizer):
    lm = tiny("qwen3", tokenizer)
    spec = output_spec(Order)
    c = Constraint(spec, lm.tokenizer)
    partials = []

    def watch(tokens, logits):
        out = c(tokens, logits)
        partials.append(c.partial())
        return out

    ids = mx.array(lm.tokenizer.encode(PROMPTS[1]))
    tokens = []
    for token, _ in generate_step(ids, lm.model, max_tokens=120, logits_processors=[watch]):
        tokens.append(token)
        if token in lm.tokenizer.eos_token_ids:
            break
    value = c.finish(tokens)
    final = json.loads(c.text)
    assert value == Order.model_validate(final)
    seen = [p for p in partials if p]
    assert len(seen) >= 2, "fields appear before the end"
    for earlier, later in zip(seen, seen[1:]):  # complete fields never change once they appear
        for key, v in earlier.items():
            if key != "items":  # the list grows; its complete items stay
                assert later[key] == v
            else:
                assert later["items"][: len(v) - 1] == v[:-1]
    assert seen[-1] == final


# -- guided turns over a session (chatkit.guided.respond / stream_respond) ------------------------------

from chatkit import ChatSession, GenerateParams, SpeculativeConfig  # noqa: E402
from chatkit.guided import respond, stream_respond  # noqa: E402


def guided_session(lm, max_tokens=120, **options):
    builder = ChatSession.builder(lm).generate_params(GenerateParams(max_tokens=max_tokens))
    for name, value in options.items():
        builder = getattr(builder, name)(value)
    return builder.build()


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_a_guided_turn_commits_its_text_and_the_next_turn_reuses_the_cache(tiny, tokenizer):
    from conftest import assert_ledger_matches_cache, fresh_reply

    lm = tiny("qwen3", tokenizer)
    session = guided_session(lm)
    session.respond("Hello there.")
    with stream_respond(session, PROMPTS[0], output=Person) as stream:
        for _ in stream:
            pass
    person = stream.value
    check_person(person)
    reply = session.history[-1]
    assert reply.role.value == "assistant" and Person.model_validate_json(reply.content) == person
    assert reply.content == reply_text(lm, stream.stream.tokens)  # invariant 6
    assert PROMPTS[0] in session.history[-2].content and '"additionalProperties":false' in session.history[-2].content
    assert_ledger_matches_cache(session)
    # Invariant 2 holds across a guided turn: the next (free) turn equals a fresh session's.
    expected = fresh_reply(session, "And then?")
    with session.stream_respond("And then?") as s:
        for _ in s:
            pass
    assert s.tokens == expected
    assert session.last_stats.reused_tokens > 0


@pytest.mark.slow
def test_regenerate_answers_a_guided_reply_with_the_same_spec(tiny):
    from conftest import assert_ledger_matches_cache

    lm = tiny("qwen3", "bpe")
    session = guided_session(lm, generate_params=GenerateParams(max_tokens=120, temperature=1.0, seed=3))
    first = session.respond(PROMPTS[0], output=Person)
    again = session.regenerate()  # a Person again, not free text (random weights never write one unguided)
    check_person(again)
    assert Person.model_validate_json(session.history[-1].content) == again and len(session.history) == 2
    check_person(first)
    day = session.respond("When?", regex=r"20\d\d-\d\d-\d\d")
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", session.regenerate()) and re.fullmatch(r"20\d\d-\d\d-\d\d", day)
    fork = session.fork()
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", fork.regenerate())
    session.respond("And then?")  # a free reply: regenerate is free again
    assert not isinstance(session.regenerate(), BaseModel)
    year = r"20[0-9][0-9]"  # ASCII digits: llguidance's \d takes digits Python's re does not
    assert re.fullmatch(year, session.respond("When?", regex=year, include_schema=False))
    session.respond("When?")  # the same text, unguided this time: its regenerate is free too
    assert not re.fullmatch(year, session.regenerate())
    assert_ledger_matches_cache(session)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "prompt_lookup"])
def test_guided_turns_with_speculative_decoding_equal_standard_ones(tiny, drafter):
    lm = tiny("qwen3", "bpe")
    draft = tiny("qwen3", "bpe", seed=1) if drafter == "model" else "prompt_lookup"
    standard = guided_session(lm)
    speculative = guided_session(lm, speculative=SpeculativeConfig(draft, num_draft_tokens=3, ngram_min=1))
    proposed = 0
    for prompt in PROMPTS:
        a = respond(standard, prompt, output=Order)
        b = respond(speculative, prompt, output=Order)
        check_order(a)
        assert a == b and standard.history == speculative.history
        proposed += speculative.last_stats.draft_tokens_proposed
    assert proposed > 0  # the drafts were checked against the grammar, not skipped


def test_an_incomplete_guided_turn_is_committed_as_far_as_it_went(tiny):
    from conftest import assert_ledger_matches_cache

    lm = tiny("qwen3", "spm")
    session = guided_session(lm, max_tokens=8)
    with pytest.raises(IncompleteOutputError) as err:
        respond(session, PROMPTS[0], output=Person, describe="none")
    assert session.history[-1].content == err.value.text and len(session.history) == 2
    assert err.value.partial == partial_json(err.value.text)
    assert_ledger_matches_cache(session)
    session.undo()
    assert session.history == []
    session.generate_params = GenerateParams(max_tokens=120)
    check_person(respond(session, PROMPTS[0], output=Person, describe="none"))


def test_a_bad_spec_changes_nothing(tiny):
    lm = tiny("qwen3", "bpe")
    session = guided_session(lm)
    session.respond("Hello there.")
    before, params = session.history, session.generate_params
    for bad in ({"output": {"type": "objekt"}}, {"regex": "a(b"}, {"grammar": 'start: ""'}, {"output": object()}):
        with pytest.raises(InvalidOutputSpecError):
            respond(session, "Hi", **bad)
    with pytest.raises(InvalidOutputSpecError):
        respond(session, "Hi", output=int, describe="somewhere")
    assert session.history == before and session.generate_params is params and not params.logits_processors
    assert not session.busy


def test_stream_value_before_the_end_is_refused(tiny):
    lm = tiny("qwen3", "bpe")
    session = guided_session(lm)
    with stream_respond(session, "Hi", output=bool) as stream:
        with pytest.raises(ChatKitError, match="not ended"):
            _ = stream.value
        for _ in stream:
            pass
    assert isinstance(stream.value, bool)


# -- the session's own keywords: respond / stream_respond / arespond / astream_respond(output=...) ------


def test_session_respond_with_output_returns_the_value(tiny):
    lm = tiny("qwen3", "gemma")
    session = guided_session(lm)
    person = session.respond(PROMPTS[0], output=Person)
    check_person(person)
    assert Person.model_validate_json(session.history[-1].content) == person
    assert session.respond(PROMPTS[1], regex=DATE) == session.history[-1].content
    assert re.fullmatch(DATE, session.history[-1].content)
    assert LARK_RE.fullmatch(session.respond(PROMPTS[1], grammar=LARK))
    assert isinstance(session.respond("Hi"), str)  # unguided turns as before


def test_session_stream_respond_with_output_streams_partial_objects(tiny):
    lm = tiny("qwen3", "bpe")
    session = guided_session(lm)
    seen = []
    with session.stream_respond(PROMPTS[1], output=Order) as stream:
        for _chunk in stream:
            seen.append(stream.partial)
    check_order(stream.value)
    assert stream.finish_reason == "stop" and stream.stats.generation_tokens == len(stream.tokens)
    assert [p for p in seen if p] and seen[-1] == json.loads(stream.text)


def test_session_async_api_with_output(tiny):
    import asyncio

    lm = tiny("qwen3", "spm")
    session = guided_session(lm)
    expected = guided_session(lm).respond(PROMPTS[0], output=Person)

    async def main():
        value = await session.arespond(PROMPTS[0], output=Person)
        partials = []
        async with session.astream_respond(PROMPTS[1], output=Order) as stream:
            async for _ in stream:
                partials.append(stream.partial)
        return value, stream.value, partials

    value, order, partials = asyncio.run(main())
    assert value == expected
    check_order(order)
    assert partials[-1] == json.loads(session.history[-1].content)


def test_session_bad_spec_raises_before_the_turn(tiny):
    lm = tiny("qwen3", "bpe")
    session = guided_session(lm)
    with pytest.raises(InvalidOutputSpecError):
        session.respond("Hi", regex="a(b")
    with pytest.raises(InvalidOutputSpecError):
        session.stream_respond("Hi", output=object())
    assert session.history == [] and not session.busy and not session.generate_params.logits_processors


def test_session_reasoning_block_stays_free_and_the_answer_is_constrained(tiny):
    """Qwen3's template knows <think>: the reply may open a reasoning block (here forced by a
    processor of the session's own, which runs before the constraint) and is free until </think>."""
    lm = tiny("qwen3", "bpe-think")
    tok = lm.tokenizer
    start, end = tok.think_start_id, tok.encode(tok.think_end, add_special_tokens=False)[0]
    session = guided_session(lm)
    counted = {}

    def think_briefly(tokens, logits):
        n = counted.setdefault("n", 0)
        counted["n"] = n + 1
        force = start if n == 0 else end if n == 6 else None
        return logits if force is None else mx.where(mx.arange(logits.shape[-1]) == force, logits, -mx.inf)

    session.generate_params = GenerateParams(max_tokens=120, logits_processors=[think_briefly])
    with session.stream_respond(PROMPTS[0], output=Person) as stream:
        for _ in stream:
            pass
    person = stream.value
    check_person(person)
    tokens = stream.tokens
    assert tokens[0] == start and tokens[6] == end
    reasoning = tok.decode(tokens[1:6])
    with pytest.raises(ValueError):
        Person.model_validate_json(reasoning)
    assert Person.model_validate_json(tok.decode(tokens[7:-1])) == person
    # The first step offers the answer's first tokens and <think>; after an answer token, no <think>.
    c = Constraint(output_spec(Person), tok, think_start=tok.think_start, think_end=tok.think_end)
    first = c.allowed(lm.model.args.vocab_size)
    opening = tok.encode('{"', add_special_tokens=False)[0]
    assert first[start] and first[opening] and first.sum() < 20
    c.advance(opening)
    assert not c.in_reasoning and not c.allowed(lm.model.args.vocab_size)[start]
    c.rollback(1)
    c.advance(start)
    assert c.in_reasoning and c.allowed(lm.model.args.vocab_size).sum() == lm.model.args.vocab_size - 2
