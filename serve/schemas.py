"""Which JSON schemas constrained decoding enforces (serve/constraints.py builds their grammars):
`unenforced` names what of a schema xgrammar would accept output against, so that the server
refuses such a schema with a 400 and an answer always validates against the schema it was asked
for. xgrammar ignores some keywords (with a warning on stderr, or silently beside `$ref`, `const`
and `enum`), and follows a oneOf whose alternatives it cannot tell apart as an anyOf.

    problem = unenforced(schema)   # None, or a sentence naming where in the schema

A schema is first checked against JSON Schema's metaschema (jsonschema, the reference the tests
validate answers with), then walked: every subschema, and every schema a `$ref` points to.
"""

import json

import jsonschema
import referencing.exceptions

# Keywords xgrammar does not enforce (it would accept output that fails them).
UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
              "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
              "patternProperties", "$dynamicRef", "$recursiveRef")
# Keywords that say nothing about which values match: allowed anywhere, beside $ref, const and enum too.
ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
               "$defs", "definitions", "$schema", "$id", "$anchor"}
SUBSCHEMAS = ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf", "allOf")  # a schema, or a list
NAMED = ("properties", "$defs", "definitions")  # {name: schema}: the names are not keywords


def unenforced(schema) -> str | None:
    """What of a JSON schema the grammar would not enforce, in a sentence naming where, or None: a
    schema that is not one (the metaschema), one of UNENFORCED, allOf of several schemas, a $ref
    that is not a pointer into the schema or has keywords beside it, const or enum values its other
    keywords refuse, multipleOf other than a whole number on integers, a string's length beside
    its pattern or format, oneOf alternatives that could both match, a required property the
    schema does not describe, an empty anyOf / oneOf / enum, an $id below the root."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "".join(f"[{p!r}]" for p in err.absolute_path) or "the schema"
        return f"{where} is not valid JSON Schema: {err.message}"
    return Walk(schema).problem(schema, "")


class Walk:
    """One schema's subschemas, each visited once ($refs may loop)."""

    def __init__(self, root):
        self.root, self.seen = root, set()

    def problem(self, schema, path: str) -> str | None:
        if isinstance(schema, list):
            return next((found for i, item in enumerate(schema) if (found := self.problem(item, f"{path}[{i}]"))),
                        None)
        if not isinstance(schema, dict) or id(schema) in self.seen:
            return None
        self.seen.add(id(schema))
        here = path or "the schema"
        found = here_problem(schema, here, self.root)
        if found is not None:
            return found
        prefix = f"{path}." if path else ""
        subschemas = [(schema[key], prefix + key) for key in SUBSCHEMAS if key in schema]
        subschemas += [(sub, f"{prefix}{key}.{name}") for key in NAMED for name, sub in schema.get(key, {}).items()]
        if "$ref" in schema:
            subschemas.append((resolved(schema, self.root), schema["$ref"]))
        return next((found for sub, at in subschemas if (found := self.problem(sub, at))), None)


def here_problem(schema: dict, here: str, root) -> str | None:
    """What of this one schema's own keywords the grammar would not enforce (see unenforced)."""
    for key in UNENFORCED:
        if key in schema:
            return f"{here} uses {key!r}, which constrained decoding does not enforce"
    if "$id" in schema and schema is not root:
        return f"{here} has an '$id' of its own, which constrained decoding does not follow"
    if len(schema.get("allOf", [])) > 1:
        return f"{here} uses 'allOf' of several schemas, which constrained decoding does not enforce"
    ref = schema.get("$ref")
    if ref is not None:
        if ref != "#" and not ref.startswith("#/"):
            return f"{here} refers to {ref!r}: constrained decoding follows only pointers into the schema ('#/...')"
        if beside := sorted(set(schema) - ANNOTATIONS - {"$ref"}):
            return f"{here} has {beside[0]!r} beside '$ref', which constrained decoding ignores"
    if (fixed := "const" if "const" in schema else "enum" if "enum" in schema else None) is not None:
        values = [schema["const"]] if fixed == "const" else schema["enum"]
        rest = {k: v for k, v in schema.items() if k != fixed and k not in ANNOTATIONS}
        if rest:  # checked as a document of its own that keeps the root's definitions, for its $refs
            definitions = {k: root[k] for k in ("$defs", "definitions") if isinstance(root, dict) and k in root}
            check = jsonschema.validators.validator_for(root)({**definitions, **rest})
            try:
                refused = [v for v in values if not check.is_valid(v)]
            except referencing.exceptions.Unresolvable as err:  # a $ref it cannot follow
                return f"{here} cannot be checked beside its {fixed!r}: {err}"
            if refused:
                return (f"{here} lists {json.dumps(refused[0])} in {fixed!r}, which its other keywords refuse: "
                        f"constrained decoding follows {fixed!r} alone")
    divisor = schema.get("multipleOf")
    if divisor is not None and not (schema.get("type") == "integer" and float(divisor).is_integer()):
        return f"{here} uses 'multipleOf' other than a whole number on integers, which constrained decoding ignores"
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    shaped = [key for key in ("pattern", "format") if key in schema]
    if lengths and shaped:
        return f"{here} gives a string {lengths[0]!r} and {shaped[0]!r}: constrained decoding enforces only the latter"
    for key in ("anyOf", "oneOf", "enum"):
        if key in schema and not schema[key]:
            return f"{here} has an empty {key!r}: nothing can match it"
    missing = [name for name in schema.get("required", []) if name not in schema.get("properties", {})]
    if missing:
        return f"{here} requires {missing[0]!r}, which its 'properties' do not describe"
    alternatives = schema.get("oneOf", [])
    if any(not disjoint(a, b, root) for i, a in enumerate(alternatives) for b in alternatives[i + 1:]):
        return (f"{here} has 'oneOf' alternatives that could both match, which constrained decoding enforces as "
                "'anyOf' (use anyOf, or alternatives of different types or told apart by a required const)")
    return None


def resolved(schema, root, depth: int = 16):
    """schema with its $ref, a JSON pointer into root ("#/$defs/Name"), followed; schema itself
    when the pointer goes nowhere (xgrammar says so when it builds the grammar) or is not one."""
    while depth and isinstance(schema, dict) and isinstance(ref := schema.get("$ref"), str) and (
            ref == "#" or ref.startswith("#/")):
        node = root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return schema
            node = node[part]
        schema, depth = node, depth - 1
    return schema


def kinds(schema, root) -> set[str] | None:
    """The JSON kinds a schema's instances can be (integers count as numbers), or None: any."""
    schema = resolved(schema, root)
    if not isinstance(schema, dict):
        return None if schema is not False else set()
    if "$ref" in schema:  # a pointer that goes nowhere
        return None
    if "const" in schema:
        return {kind_of(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {kind_of(value) for value in schema["enum"]}
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        return None
    return {"number" if t == "integer" else t for t in types}


def kind_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def tags(schema, root) -> dict[str, set[str]]:
    """An object schema's required properties whose values it fixes (const or enum): name -> the
    values' canonical texts."""
    schema = resolved(schema, root)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    fixed = {}
    for name in schema.get("required", []) if isinstance(properties, dict) else []:
        value = resolved(properties.get(name), root)
        if isinstance(value, dict) and "const" in value:
            fixed[name] = {canonical(value["const"])}
        elif isinstance(value, dict) and isinstance(value.get("enum"), list):
            fixed[name] = {canonical(v) for v in value["enum"]}
    return fixed


def canonical(value) -> str:
    """A JSON value's text, equal for values JSON Schema holds equal (1 and 1.0; 0 and -0.0)."""
    def normal(v):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, list):
            return [normal(x) for x in v]
        return {k: normal(x) for k, x in v.items()} if isinstance(v, dict) else v

    return json.dumps(normal(value), sort_keys=True)


def disjoint(a, b, root) -> bool:
    """Whether no JSON value can match both schemas, as far as their kinds (types, consts, enums)
    or, for two object schemas, a required property fixed to different values in each (a tagged
    union's alternatives) show; False when that cannot be told."""
    kinds_a, kinds_b = kinds(a, root), kinds(b, root)
    if kinds_a is not None and kinds_b is not None and not kinds_a & kinds_b:
        return True
    if kinds_a != {"object"} or kinds_b != {"object"}:
        return False
    tags_a, tags_b = tags(a, root), tags(b, root)
    return any(name in tags_b and not values & tags_b[name] for name, values in tags_a.items())


def opened(schema):
    """schema as xgrammar must read it to mean what JSON Schema does, a copy. xgrammar takes what a
    schema leaves open as closed once a count asks for more: an array with minItems and no items
    (JSON Schema: any items) gets `items: true`, an object with minProperties beyond the properties
    it names (JSON Schema: other properties allowed) `additionalProperties: true`."""
    if isinstance(schema, list):
        return [opened(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: opened(value) if key in SUBSCHEMAS else
           {name: opened(sub) for name, sub in value.items()} if key in NAMED and isinstance(value, dict) else value
           for key, value in schema.items()}
    if "minItems" in out and "items" not in out:
        out["items"] = True
    if out.get("minProperties", 0) > len(out.get("properties", {})) and "additionalProperties" not in out:
        out["additionalProperties"] = True
    return out
