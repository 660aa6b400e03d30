"""Issue 33, item 2: a tool whose parameters schema cannot be checked is refused when it is given
(``builder.tools``, ``session.tools = ...``), with ``InvalidParamsError`` naming the tool and the
problem; before, the builder took it and ``respond()`` raised jsonschema's, ``re``'s or a
``TypeError`` when the model called it, leaving the call unanswered. Remote ``$ref`` s are never
fetched."""

import json
import sys
import urllib.request

from chatkit import ChatSession, GenerateParams, InvalidParamsError
from chatkit.testing import Scripted
from chatkit.tools import Tool

import pytest


def f(**arguments) -> str:
    return "ok"


def _nested(depth):
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"type": "array", "items": node}
    return node


BAD = {
    "an unknown type": ({"x": {"type": "strnig"}}, "unknown type 'strnig'"),
    "a dangling $ref": ({"x": {"$ref": "#/$defs/nothing"}}, "'#/\\$defs/nothing'"),
    "a remote $ref": ({"x": {"$ref": "http://127.0.0.1:9/schema.json"}}, "never fetches"),
    "a bad pattern": ({"x": {"type": "string", "pattern": "["}}, "not a valid regular expression"),
    "a count that is text": ({"x": {"type": "string", "minLength": "two"}}, "'two' is not a count"),
    "a schema 3,000 deep": ({"x": _nested(3000)}, "nested more than"),
}


def _schema(properties, **extra):
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties, **extra}}}


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture
def lm(tiny):
    return tiny(tokenizer="bpe-think")


@pytest.fixture(autouse=True)
def nothing_fetched(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a schema was fetched from the network")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_tool_schema_is_refused_when_given_naming_the_tool_and_the_problem(lm, case):
    properties, problem = BAD[case]
    for tool in (_schema(properties), Tool(_schema(properties), f)):  # a dict, and a dict with its function
        with pytest.raises(InvalidParamsError, match=f"Tool 'f'.*{problem}"):
            ChatSession.builder(lm).tools([tool])
    session = ChatSession.builder(lm).tools([Tool(_schema({"x": {"type": "string"}}), f)]).build()
    with pytest.raises(InvalidParamsError, match="Tool 'f'"):
        session.tools = [Tool(_schema(properties), f)]
    assert session.tools == [_schema({"x": {"type": "string"}})] and not session.busy


def test_the_extra_keywords_are_checked_too(lm):
    for extra, problem in (({"required": 5}, "not a list of property names"), ({"type": 5}, "unknown type 5")):
        with pytest.raises(InvalidParamsError, match=problem):
            ChatSession.builder(lm).tools([Tool(_schema({}, **extra), f)])


def test_without_jsonschema_what_chatkit_can_check_by_itself_is_still_refused(lm, monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # `import jsonschema` raises ImportError
    for properties, problem in BAD.values():
        with pytest.raises(InvalidParamsError, match=f"Tool 'f'.*{problem}"):
            ChatSession.builder(lm).tools([Tool(_schema(properties), f)])


def test_a_good_schema_with_local_refs_is_taken_and_its_calls_are_checked(lm):
    schema = _schema({"city": {"$ref": "#/$defs/city"}}, required=["city"], **{"$defs": {"city": {"type": "string", "pattern": "^[A-Z]"}}})
    script = Scripted(lm.tokenizer, [call("f", city="oslo"), call("f", city="Oslo"), "Done."])
    session = (ChatSession.builder(lm).tools([Tool(schema, f)])
               .generate_params(GenerateParams(max_tokens=60, logits_processors=[script])).build())
    assert session.respond("Go.") == "Done."
    results = [m.content for m in session.history if m.role.value == "tool"]
    assert results[0].startswith("Error: Invalid arguments for f: city: 'oslo' does not match") and results[1] == "ok"
