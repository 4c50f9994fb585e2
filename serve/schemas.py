"""Which JSON schemas constrained decoding enforces (serve/constraints.py builds their grammars):
`unenforced` names what of a schema xgrammar would accept output against (it ignores some keywords
with a warning, and a oneOf whose alternatives it cannot tell apart it follows as anyOf), so that
the server refuses such a schema with a 400 and an answer always validates against the schema it
was asked for.

    problem = unenforced(schema)   # None, or a sentence naming where in the schema
"""

import json

# JSON Schema keywords that xgrammar does not enforce (it would accept output that fails them):
# refused, so that an answer always validates against the schema it was asked for.
UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "contains",
              "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
              "patternProperties")


def unenforced(schema, path: str = "", root=None) -> str | None:
    """What of a JSON schema the grammar would not enforce, in a sentence naming where, or None:
    one of UNENFORCED, allOf of several schemas, multipleOf on numbers that need not be integers,
    a string's length beside its pattern or format, oneOf alternatives that could both match, a
    $ref outside the document, a required property the schema does not describe, an empty anyOf /
    oneOf / enum (nothing could match), one of those keywords not an array (xgrammar does not read
    a subschema that nothing refers to). root: the whole schema ($refs point into it)."""
    root = schema if root is None else root
    if isinstance(schema, list):
        return next((found for i, item in enumerate(schema) if (found := unenforced(item, f"{path}[{i}]", root))),
                    None)
    if not isinstance(schema, dict):
        return None
    here, prefix = path or "the schema", f"{path}." if path else ""
    for key in UNENFORCED:
        if key in schema:
            return f"{here} uses {key!r}, which constrained decoding does not enforce"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"{here} uses 'multipleOf' on numbers that need not be integers, which constrained decoding ignores"
    lengths = [key for key in ("minLength", "maxLength") if key in schema]
    shaped = [key for key in ("pattern", "format") if key in schema]
    if lengths and shaped:
        return f"{here} gives a string {lengths[0]!r} and {shaped[0]!r}: constrained decoding enforces only the latter"
    for key in ("allOf", "anyOf", "oneOf", "enum", "required"):  # xgrammar skips what nothing refers to
        if key in schema and not isinstance(schema[key], list):
            return f"{here} has {key!r} of {type(schema[key]).__name__}, where JSON Schema wants an array"
    if not all(isinstance(name, str) for name in schema.get("required", [])):
        return f"{here} has 'required' names that are not strings"
    if len(schema.get("allOf", [])) > 1:
        return f"{here} uses 'allOf' of several schemas, which constrained decoding does not enforce"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"{here} refers to {ref!r} outside the schema"
    for key in ("anyOf", "oneOf", "enum"):
        if key in schema and not schema[key]:
            return f"{here} has an empty {key!r}: nothing can match it"
    properties = schema.get("properties")
    described = properties if isinstance(properties, dict) else {}
    missing = [name for name in schema.get("required", []) if name not in described]
    if missing:
        return f"{here} requires {missing[0]!r}, which its 'properties' do not describe"
    alternatives = schema.get("oneOf", [])
    if any(not disjoint(a, b, root) for i, a in enumerate(alternatives) for b in alternatives[i + 1:]):
        return (f"{here} has 'oneOf' alternatives that could both match, which constrained decoding enforces as "
                "'anyOf' (use anyOf, or alternatives of different types or told apart by a required const)")
    subschemas = [(value, prefix + key) for key in ("items", "additionalProperties", "prefixItems", "anyOf", "oneOf",
                                                    "allOf") if isinstance(value := schema.get(key), (dict, list))]
    for key in ("properties", "$defs", "definitions"):  # named subschemas: the names are not keywords
        if isinstance(schema.get(key), dict):
            subschemas += [(sub, f"{prefix}{key}.{name}") for name, sub in schema[key].items()]
    return next((found for sub, at in subschemas if (found := unenforced(sub, at, root))), None)


def resolved(schema, root, depth: int = 16):
    """schema with its local $ref ("#/$defs/Name", any JSON pointer into root) followed; schema
    itself when the reference goes nowhere (xgrammar says so when it builds the grammar)."""
    while depth and isinstance(schema, dict) and isinstance(ref := schema.get("$ref"), str) and ref.startswith("#"):
        node = root
        for part in ref[1:].split("/")[1:]:
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
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            return None
        return {"number" if t == "integer" else t for t in types}
    return {kind_of(value) for value in values}


def kind_of(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "number", float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def tags(schema, root) -> dict[str, set[str]]:
    """An object schema's required properties whose values it fixes (const or enum): name -> the
    values' JSON texts."""
    schema = resolved(schema, root)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    fixed = {}
    for name in schema.get("required", []) if isinstance(properties, dict) else []:
        value = resolved(properties.get(name), root)
        if isinstance(value, dict) and "const" in value:
            fixed[name] = {json.dumps(value["const"], sort_keys=True)}
        elif isinstance(value, dict) and isinstance(value.get("enum"), list):
            fixed[name] = {json.dumps(v, sort_keys=True) for v in value["enum"]}
    return fixed


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
