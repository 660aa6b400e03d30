"""Checking a tool's parameters schema when the tool is given, so that a call never fails on the
schema itself (a raw jsonschema, ``re`` or ``TypeError`` in the middle of a turn, with the call left
unanswered).

Without the ``tools`` extra (jsonschema) a call's arguments are checked only for the required keys,
so what is checked here is what that reads and what chatkit can check by itself: the nesting depth,
``$ref`` s, type names, patterns, counts and bounds. With jsonschema the schema is also checked
against the JSON Schema 2020-12 meta-schema, and every ``$ref`` is resolved the way jsonschema will.
A ``$ref`` outside the schema is refused, never fetched.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import InvalidParamsError

MAX_DEPTH = 64  # JSON objects and arrays nested in one schema; generated schemas use a handful

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "unevaluatedItems",
        "propertyNames", "additionalProperties", "unevaluatedProperties")
_MANY = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_REFS = ("$ref", "$dynamicRef")


class _Bad(Exception):
    """A problem at a place in the schema (``where``: a JSON pointer)."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(problem)
        self.where, self.problem = where, problem


def check_parameters(tool: str, parameters: Mapping[str, Any]) -> None:
    """``InvalidParamsError`` naming ``tool`` and the problem unless ``parameters`` is a JSON Schema a
    call's arguments can be checked against."""
    try:
        _check_depth(parameters)
        nodes = list(_nodes(parameters, ""))
        for where, node in nodes:
            _check_node(where, node, parameters)
        _check_with_jsonschema(parameters, nodes)
    except _Bad as bad:
        where = f"at {bad.where}" if bad.where else "at its root"
        raise InvalidParamsError(
            f"Tool {tool!r}: its parameters schema is invalid {where}: {bad.problem}. Fix the schema "
            "(JSON Schema 2020-12) before giving the tool."
        ) from None


def _check_depth(schema: Any) -> None:
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Bad("", f"it is nested more than {MAX_DEPTH} levels deep")
        children = node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (Mapping, list)))


def _nodes(node: Any, where: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every subschema that is an object, with its JSON pointer (``_Bad`` for one that is not a schema)."""
    if isinstance(node, bool):
        return
    if not isinstance(node, Mapping):
        raise _Bad(where, f"{node!r} is not a schema (an object, or true / false)")
    yield where, node
    for key in _ONE:
        if key in node:
            yield from _nodes(node[key], f"{where}/{key}")
    for key in _MANY:
        if key in node:
            if not isinstance(node[key], list):
                raise _Bad(f"{where}/{key}", "must be a list of schemas")
            for i, sub in enumerate(node[key]):
                yield from _nodes(sub, f"{where}/{key}/{i}")
    for key in _MAP:
        if key in node:
            if not isinstance(node[key], Mapping):
                raise _Bad(f"{where}/{key}", "must be an object of schemas")
            for name, sub in node[key].items():
                yield from _nodes(sub, f"{where}/{key}/{_escape(name)}")


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _check_node(where: str, node: Mapping[str, Any], root: Mapping[str, Any]) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    unknown = [k for k in kinds if k not in _TYPES]
    if unknown:
        raise _Bad(f"{where}/type", f"unknown type {unknown[0]!r} (the types are {', '.join(sorted(_TYPES))})")
    patterns = [(f"{where}/pattern", node["pattern"])] if "pattern" in node else []
    if isinstance(node.get("patternProperties"), Mapping):
        patterns += [(f"{where}/patternProperties", p) for p in node["patternProperties"]]
    for at, pattern in patterns:
        _check_pattern(at, pattern)
    for key in _COUNTS:
        value = node.get(key)
        if key in node and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise _Bad(f"{where}/{key}", f"{value!r} is not a count (an integer >= 0)")
    for key in _BOUNDS:
        value = node.get(key)
        if key in node and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise _Bad(f"{where}/{key}", f"{value!r} is not a number")
    if "multipleOf" in node and node["multipleOf"] <= 0:
        raise _Bad(f"{where}/multipleOf", "must be greater than 0")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _Bad(f"{where}/required", f"{required!r} is not a list of property names")
    for key in _REFS:
        if key in node:
            _check_ref(f"{where}/{key}", node[key], root)


def _check_pattern(where: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise _Bad(where, f"{pattern!r} is not a regular expression (a string)")
    try:
        re.compile(pattern)  # what jsonschema matches with
    except (re.error, RecursionError, OverflowError) as exc:
        raise _Bad(where, f"{pattern!r} is not a valid regular expression ({exc})") from None


def _check_ref(where: str, ref: Any, root: Mapping[str, Any]) -> None:
    """A ``$ref`` is a pointer into this schema (``#/$defs/name``); anything else would be fetched."""
    if not isinstance(ref, str):
        raise _Bad(where, f"{ref!r} is not a reference (a string)")
    if not ref.startswith("#"):
        return  # resolved below with jsonschema's own resolver (which may know the schema's $id)
    if ref.startswith("#/") or ref == "#":
        node: Any = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, Mapping) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _Bad(where, f"{ref!r} points to nothing in the schema (define it under $defs)")


def _check_with_jsonschema(schema: Mapping[str, Any], nodes: list[tuple[str, Mapping[str, Any]]]) -> None:
    """The meta-schema check and every ``$ref`` resolved as jsonschema will, without fetching
    anything; without jsonschema, a ``$ref`` that is not a pointer into the schema is refused."""
    try:
        import jsonschema
        from referencing import Registry
        from referencing.jsonschema import DRAFT202012
    except ImportError:
        for where, node in nodes:
            for key in _REFS:
                if isinstance(node.get(key), str) and not node[key].startswith("#"):
                    raise _Bad(f"{where}/{key}", f"{node[key]!r} is not a pointer into the schema "
                               "(chatkit never fetches schemas: define it under $defs)") from None
        return
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _Bad("/" + "/".join(_escape(str(p)) for p in exc.path), exc.message) from None
    resolver = Registry().resolver_with_root(DRAFT202012.create_resource(schema))  # no retrieval: nothing fetched
    _resolve_refs(schema, "", resolver, DRAFT202012)


def _resolve_refs(node: Any, where: str, resolver: Any, spec: Any) -> None:
    if not isinstance(node, Mapping):
        return
    resolver = resolver.in_subresource(spec.create_resource(node))  # a nested $id moves the base
    for key in _REFS:
        if isinstance(node.get(key), str):
            try:
                resolver.lookup(node[key])
            except Exception as exc:  # referencing's Unresolvable family (remote: Unretrievable)
                raise _Bad(f"{where}/{key}", f"{node[key]!r} cannot be resolved within the schema ({type(exc).__name__}; "
                           "chatkit never fetches schemas: define it under $defs)") from None
    for key in _ONE:
        _resolve_refs(node.get(key), f"{where}/{key}", resolver, spec)
    for key in _MANY:
        for i, sub in enumerate(node.get(key) or []):
            _resolve_refs(sub, f"{where}/{key}/{i}", resolver, spec)
    for key in _MAP:
        for name, sub in (node.get(key) or {}).items():
            _resolve_refs(sub, f"{where}/{key}/{_escape(name)}", resolver, spec)


__all__ = ["MAX_DEPTH", "check_parameters"]
