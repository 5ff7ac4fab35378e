"""A JSON Schema (draft 2020-12) of space files, for editors (`sweeper schema`).

Built from the space loader's own tables (sweeper/sweep/space.py: the field names, the
searchable parameters and which are integers, layouts, samplers, directions, metrics,
hardware kinds), so it cannot drift from what `load_space` accepts: a field added to
the loader without a type here makes `space_schema()` raise (tests/test_overrides_schema.py).
The schema checks shape and names; the loader still checks what a schema cannot
(a topology's product, a point that can run, a sampler's options).
"""

from __future__ import annotations

import re
from typing import Any

from sweeper.sweep import space as sp
from workloads.layouts import WEIGHT_FORMATS

SCHEMA_ID = "https://sweeper.invalid/space.schema.json"

_INT = {"type": "integer"}
_QUANTITY = {"anyOf": [{"type": "number"}, {"type": "string"}],
             "description": "a number or a quantity with a unit, e.g. 2GiB"}
_TOPOLOGY = {"anyOf": [{"type": "string", "pattern": r"^(auto|\d+\s*[x×]\s*\d+\s*[x×]\s*\d+)$"},
                       {"type": "array", "items": _INT, "minItems": 3, "maxItems": 3},
                       {"type": "null"}],
             "description": "XxYxZ (product = chips), [X, Y, Z] or auto"}


def _phase_layout() -> dict:
    return {"type": "object", "additionalProperties": False,
            "properties": {"ffn": {"enum": list(sp.LAYOUT_PARAMS["ffn"])},
                           "attn": {"enum": list(sp.LAYOUT_PARAMS["attn"])}}}


# pad_heads (workloads/trial.py parse_pad_heads): auto | none | a positive integer.
_PAD_HEADS = {"anyOf": [{"enum": ["auto", "none", None, False]}, {"type": "integer", "minimum": 1}]}


def _fixed_field(name: str) -> dict:
    """The schema of one fixed trial field; a KeyError for a field added without one."""
    minimum = 0 if name in ("seed", "warmup", "decode_steps") else 1
    types = {"prefill": _phase_layout(), "decode": _phase_layout(), "topology": _TOPOLOGY,
             "weights": {"enum": list(WEIGHT_FORMATS)},
             "ci_target": {"type": "number", "minimum": 0},
             "time_budget_s": {"type": "number", "minimum": 0}, "pad_heads": _PAD_HEADS}
    if name in types:
        return types[name]
    if name in ("chips", "batch", "input_len", "decode_steps", "seed", "repeats", "warmup",
                "hosts"):
        return {"type": "integer", "minimum": minimum}
    raise KeyError(f"no JSON Schema type for the fixed field {name!r}: add it to schema.py")


def _param_value(name: str) -> dict:
    if name in sp.INT_PARAMS:
        return {"type": "integer", "minimum": 0 if name in ("decode_steps", "seed") else 1}
    if name in sp.LAYOUT_PARAMS:
        return {"enum": list(sp.LAYOUT_PARAMS[name])}
    if name == "weights":
        return {"enum": list(WEIGHT_FORMATS)}
    if name == "topology":
        return _TOPOLOGY["anyOf"][0]
    if name == "pad_heads":
        return _PAD_HEADS
    raise KeyError(f"no JSON Schema type for the searchable parameter {name!r}: add it to schema.py")


def _param(name: str) -> dict:
    choices = {"type": "array", "items": _param_value(name), "minItems": 1, "uniqueItems": True}
    forms = [choices, {"type": "object", "additionalProperties": False, "required": ["choices"],
                       "properties": {"choices": choices}}]
    if name in sp.INT_PARAMS:
        forms.append({"type": "object", "additionalProperties": False, "required": ["low", "high"],
                      "properties": {"low": _param_value(name), "high": _param_value(name),
                                     "log": {"type": "boolean"}, "step": {"type": "integer", "minimum": 1}}})
    return {"oneOf": forms}


def _space_field(name: str) -> dict:
    metric = {"enum": list(sp.NUMERIC_METRICS)}
    objective = {"anyOf": [metric, {"type": "object", "additionalProperties": False,
                                    "required": ["metric"],
                                    "properties": {"metric": metric,
                                                   "direction": {"enum": list(sp.DIRECTIONS)}}}]}
    kinds = "|".join(map(re.escape, sp.HARDWARE_KINDS))
    constraint = r"^\s*(" + "|".join(sp.NUMERIC_METRICS) + r")\s*(<=|>=|<|>)\s*\S.*$"
    types = {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"},
        "description": {"type": "string"},
        "model": {"anyOf": [{"type": "string"}, {"type": "object"}],
                  "description": "a model preset, a model YAML (relative to the space file) or a mapping"},
        "hardware": {"type": "string", "pattern": rf"^({kinds})(:.+)?$",
                     "description": "host | devices | devices:<profile> | analytical:<profile or YAML>"},
        "params": {"type": "object", "additionalProperties": False,
                   "properties": {p: _param(p) for p in sp.PARAM_NAMES}},
        "objectives": {"anyOf": [objective, {"type": "array", "items": objective, "minItems": 1}]},
        "constraints": {"anyOf": [{"type": "string", "pattern": constraint},
                                  {"type": "array", "items": {"type": "string", "pattern": constraint}}]},
        "sampler": {"anyOf": [{"enum": list(sp.SAMPLERS)},
                              {"type": "object", "additionalProperties": False,
                               "properties": {"type": {"enum": list(sp.SAMPLERS)},
                                              "seed": {"type": ["integer", "null"], "minimum": 0},
                                              "options": {"type": "object"}}}]},
        "trials": {"type": "integer", "minimum": 1},
        "parallel": {"type": "integer", "minimum": 1},
        "timeout_s": _QUANTITY,
        "max_retries": {"type": "integer", "minimum": 0},
        "memory_budget_bytes": _QUANTITY,
        "resources": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
        "verify": {"type": "boolean",
                   "description": "measured trials also run the unsharded reference"},
    }
    if name not in types:
        raise KeyError(f"no JSON Schema type for the space field {name!r}: add it to schema.py")
    return types[name]


def space_schema() -> dict[str, Any]:
    """The JSON Schema of a space file."""
    properties = {name: _space_field(name) for name in sp.SPACE_FIELDS}
    properties.update({name: _fixed_field(name) for name in sp.FIXED_FIELDS})
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "sweeper search space",
            "description": "A search-space file of `sweeper run` (README, 'Search spaces').",
            "type": "object", "additionalProperties": False, "required": ["model"],
            "properties": properties}
