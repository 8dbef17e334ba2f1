"""Hypothesis strategies for request bodies that an OpenAPI 3.1 schema says are INVALID.

Negative testing from the schema the server publishes: take a valid body, break exactly one
thing the schema constrains (a field's type, a bound, an enum, a length, a required field,
a header's enum, the body's own type) and keep the result only if a JSON Schema validator
agrees that it is invalid. The server must then answer 400 naming the broken field.

Only JSON values are generated (no NaN or infinities: those are not JSON, and a validator
cannot judge them); the fuzz tests cover such tokens separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jsonschema
from hypothesis import strategies as st

Schema = dict[str, Any]

_FINITE_FLOATS = partial(st.floats, allow_nan=False, allow_infinity=False)
_FINITE = _FINITE_FLOATS()
_SCALARS = st.none() | st.booleans() | st.integers() | _FINITE | st.text(max_size=8)
_WRONG_TYPE_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(),
    "number": _FINITE.filter(lambda x: not x.is_integer()),
    "string": st.text(max_size=12),
    "array": st.lists(_SCALARS, max_size=3),
    "object": st.dictionaries(st.text(max_size=6), _SCALARS, max_size=3),
}
_HEADER_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=24)


@dataclass(frozen=True, slots=True)
class BadRequest:
    """One schema-invalid request; ``field`` is what the error must name (None: the body)."""

    body: Any
    headers: dict[str, str] = field(default_factory=dict)
    field: str | None = None
    broken: str = ""  # "property", "missing", "header" or "body"


class OpenApiFuzzer:
    """Builds schema-invalid values and requests from a published OpenAPI document."""

    def __init__(self, openapi: Schema) -> None:
        self.openapi = openapi
        self.components: Schema = openapi["components"]["schemas"]

    def is_valid(self, schema: Schema, value: Any) -> bool:
        """Does ``value`` satisfy ``schema`` (whose ``$ref``s point into the components)?"""
        rooted = {**schema, "components": {"schemas": self.components}}
        return bool(jsonschema.Draft202012Validator(rooted).is_valid(value))

    def request_schema(self, path: str) -> Schema:
        content = self.openapi["paths"][path]["post"]["requestBody"]["content"]
        return self._resolve(content["application/json"]["schema"])

    def bad_requests(self, path: str, valid_body: Schema) -> st.SearchStrategy[BadRequest]:
        """Requests to ``path`` that break one thing in ``valid_body`` or its headers."""
        schema = self.request_schema(path)
        assert self.is_valid(schema, valid_body), f"the base body of {path} is invalid"
        kinds: list[st.SearchStrategy[BadRequest]] = [
            *[self._bad_property(schema, valid_body)] * 8,
            st.sampled_from(schema.get("required", [])).map(
                lambda name: BadRequest(_without(valid_body, name), field=name, broken="missing")
            ),
            self.wrong_type(schema).map(lambda body: BadRequest(body, broken="body")),
        ]
        kinds.extend(self._bad_headers(path, valid_body))
        return st.one_of(kinds)

    def invalid_value(self, schema: Schema, depth: int = 0) -> st.SearchStrategy[Any]:
        """Values that ``schema`` rejects: a wrong type, or one broken constraint inside."""
        schema = self._resolve(schema)
        options = [self.wrong_type(schema)]
        for branch in self._branches(schema):
            options.extend(self._violations(branch, depth))
        return st.one_of(options).filter(lambda value: not self.is_valid(schema, value))

    def valid_value(self, schema: Schema, depth: int = 0) -> st.SearchStrategy[Any]:
        """Values that ``schema`` accepts (small ones: strings and arrays stay short)."""
        schema = self._resolve(schema)
        options = [self._valid_branch(branch, depth) for branch in self._branches(schema)]
        return st.one_of(options).filter(lambda value: self.is_valid(schema, value))

    def _valid_branch(self, branch: Schema, depth: int) -> st.SearchStrategy[Any]:
        if "const" in branch or "enum" in branch:
            return st.sampled_from(branch.get("enum", [branch.get("const")]))
        kind = branch.get("type")
        if kind in ("integer", "number"):
            low, high = branch.get("minimum"), branch.get("maximum")
            if kind == "number":
                return _FINITE_FLOATS(min_value=low, max_value=high)
            return st.integers(
                None if low is None else math.ceil(low), None if high is None else math.floor(high)
            )
        if kind == "string":
            least = branch.get("minLength", 0)
            return st.text(min_size=least, max_size=max(least, 24))
        if kind == "array":
            least = branch.get("minItems", 0)
            most = max(least, min(branch.get("maxItems", 3), 3))
            items = self.valid_value(branch["items"], depth + 1)
            return st.lists(items, min_size=least, max_size=most)
        if kind == "object":
            props = branch.get("properties", {})
            required = set(branch.get("required", []))
            strategies = {n: self.valid_value(s, depth + 1) for n, s in props.items()}
            return st.fixed_dictionaries(
                {n: v for n, v in strategies.items() if n in required},
                optional={n: v for n, v in strategies.items() if n not in required},
            )
        if kind == "null":
            return st.none()
        return st.booleans() if kind == "boolean" else _SCALARS

    def wrong_type(self, schema: Schema) -> st.SearchStrategy[Any]:
        accepted = self._accepted_types(self._resolve(schema))
        if "number" in accepted:
            accepted.add("integer")
        wrong = [s for t, s in _WRONG_TYPE_VALUES.items() if t not in accepted]
        return st.one_of(wrong) if wrong else st.nothing()

    def example(self, schema: Schema) -> Any:
        """One valid value of ``schema`` (the smallest that satisfies its constraints)."""
        branch = self._branches(self._resolve(schema))[0]
        for key in ("const", "default"):
            if key in branch and self.is_valid(branch, branch[key]):
                return branch[key]
        if "enum" in branch:
            return branch["enum"][0]
        kind = branch.get("type")
        if kind in ("integer", "number"):
            low = branch.get("minimum", 0)
            return math.ceil(low) if kind == "integer" else float(low)
        if kind == "string":
            return "a" * branch.get("minLength", 0)
        if kind == "array":
            return [self.example(branch["items"])] * branch.get("minItems", 0)
        if kind == "object":
            props = branch.get("properties", {})
            return {name: self.example(props[name]) for name in branch.get("required", [])}
        return False if kind == "boolean" else None  # null, or no type at all

    def _bad_property(self, schema: Schema, body: Schema) -> st.SearchStrategy[BadRequest]:
        props = schema["properties"]
        return st.sampled_from(sorted(props)).flatmap(
            lambda name: self.invalid_value(props[name]).map(
                lambda value: BadRequest({**body, name: value}, field=name, broken="property")
            )
        )

    def _bad_headers(self, path: str, body: Schema) -> list[st.SearchStrategy[BadRequest]]:
        out = []
        for param in self.openapi["paths"][path]["post"].get("parameters", []):
            if param["in"] == "header":
                out.append(self._bad_header(body, param["name"], param["schema"]))
        return out

    def _bad_header(self, body: Schema, name: str, schema: Schema) -> st.SearchStrategy[BadRequest]:
        # The server strips a header value's surrounding whitespace before validating.
        values = (_HEADER_TEXT | st.just("")).filter(lambda v: not self.is_valid(schema, v.strip()))
        return values.map(lambda v: BadRequest(body, {name: v}, field=name, broken="header"))

    def _violations(self, branch: Schema, depth: int) -> list[st.SearchStrategy[Any]]:
        kind = branch.get("type")
        out: list[st.SearchStrategy[Any]] = []
        if "enum" in branch or "const" in branch:
            allowed = branch.get("enum", [branch.get("const")])
            out.append(_near_misses(allowed))
        if kind in ("integer", "number"):
            out.extend(_out_of_range(branch, kind))
        elif kind == "string" and branch.get("minLength", 0) > 0:
            out.append(st.text(max_size=branch["minLength"] - 1))
        elif kind == "array":
            out.extend(self._bad_arrays(branch, depth))
        elif kind == "object" and depth < 3:
            out.extend(self._bad_objects(branch, depth))
        return out

    def _bad_arrays(self, branch: Schema, depth: int) -> list[st.SearchStrategy[Any]]:
        item = self.example(branch["items"])
        out: list[st.SearchStrategy[Any]] = []
        if branch.get("minItems", 0) > 0:
            out.append(st.just([item] * (branch["minItems"] - 1)))
        if "maxItems" in branch:
            too_many = st.integers(branch["maxItems"] + 1, branch["maxItems"] + 8)
            out.append(too_many.map(lambda k: [item] * k))
        if depth < 3:
            room = max(1, min(branch.get("maxItems", 3), 3))
            out.append(
                st.tuples(
                    self.invalid_value(branch["items"], depth + 1), st.integers(0, room - 1)
                ).map(lambda bad_at: [item] * bad_at[1] + [bad_at[0]])
            )
        return out

    def _bad_objects(self, branch: Schema, depth: int) -> list[st.SearchStrategy[Any]]:
        valid = self.example(branch)
        props = branch.get("properties", {})
        out: list[st.SearchStrategy[Any]] = []
        if branch.get("required"):
            out.append(st.sampled_from(branch["required"]).map(lambda n: _without(valid, n)))
        if props:
            out.append(
                st.sampled_from(sorted(props)).flatmap(
                    lambda n: self.invalid_value(props[n], depth + 1).map(lambda v: {**valid, n: v})
                )
            )
        return out

    def _resolve(self, schema: Schema) -> Schema:
        while "$ref" in schema:
            schema = self.components[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def _branches(self, schema: Schema) -> list[Schema]:
        options: list[Schema] = schema.get("anyOf") or schema.get("oneOf") or [schema]
        return [self._resolve(s) for s in options]

    def _accepted_types(self, schema: Schema) -> set[str]:
        types: set[str] = set()
        for branch in self._branches(schema):
            kind = branch.get("type")
            if kind is None:
                return set(_WRONG_TYPE_VALUES)  # untyped: anything goes
            types.update([kind] if isinstance(kind, str) else kind)
        return types


def _out_of_range(branch: Schema, kind: str) -> list[st.SearchStrategy[Any]]:
    out: list[st.SearchStrategy[Any]] = []
    if "minimum" in branch:
        low = branch["minimum"]
        out.append(
            st.floats(max_value=low, exclude_max=True, allow_nan=False, allow_infinity=False)
        )
        if kind == "integer":
            out.append(st.integers(max_value=math.ceil(low) - 1))
    if "maximum" in branch:
        high = branch["maximum"]
        out.append(
            st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False)
        )
        if kind == "integer":
            out.append(st.integers(min_value=math.floor(high) + 1))
    return out


def _near_misses(allowed: list[Any]) -> st.SearchStrategy[Any]:
    """Strings close to an allowed value (case, padding) and arbitrary others."""
    texts = [a for a in allowed if isinstance(a, str)]
    close = [v for a in texts for v in (a.upper(), f" {a}", f"{a}-", a[:-1])]
    others = st.text(max_size=20) | st.booleans().map(lambda b: not b)
    pool = st.sampled_from(close) | others if close else others
    return pool.filter(lambda v: v not in allowed)


def _without(body: Schema, name: str) -> Schema:
    return {k: v for k, v in body.items() if k != name}
