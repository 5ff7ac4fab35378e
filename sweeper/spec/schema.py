"""A JSON Schema (draft 2020-12) of space files, for editors (`sweeper schema`).

Built from the declarations the loader itself checks against: the trial fields' metadata
on `TrialConfig` (workloads/trial.py: integer and minimum, choices, phase-layout parts,
help and unit) and the space loader's tables (sweeper/spec/space.py: field names, the
searchable parameters, samplers, directions, metrics, hardware kinds), so it cannot drift
from what `load_space` accepts. A trial field whose metadata a schema cannot express
(it has its own `parse`) needs an entry in `_CUSTOM`, or `space_schema()` raises
(tests/test_overrides_schema.py). The schema checks shape and names; the loader still
checks what a schema cannot (a topology's product, a point that can run, a sampler's options).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from sweeper.spec import space as sp
from workloads.trial import TRIAL_FIELDS

SCHEMA_ID = "https://sweeper.invalid/space.schema.json"

_QUANTITY = {"anyOf": [{"type": "number"}, {"type": "string"}],
             "description": "a number or a quantity with a unit, e.g. 2GiB"}
_TOPOLOGY_TEXT = {"type": "string", "pattern": r"^(auto|\d+\s*[x×]\s*\d+\s*[x×]\s*\d+)$"}
# Trial fields parsed by their own function (metadata `parse`): their schema, by hand.
_CUSTOM: dict[str, dict] = {
    "topology": {"anyOf": [_TOPOLOGY_TEXT,
                           {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3},
                           {"type": "null"}]},
    # workloads/trial.py parse_pad_heads: auto | none | a positive integer
    "pad_heads": {"anyOf": [{"enum": ["auto", "none", None, False]}, {"type": "integer", "minimum": 1}]},
    # workloads/trial.py parse_serving: the application profile's fields plus `requests`
    "serving": {"type": ["object", "null"]},
}


def _described(schema: dict, meta: Mapping[str, Any]) -> dict:
    unit = f" [{meta['unit']}]" if meta.get("unit") else ""
    return {**schema, "description": meta["help"] + unit}


def _value(meta: Mapping[str, Any], name: str, what: str) -> dict:
    """The schema of one value of a trial field, from its metadata."""
    if meta.get("integer"):
        return {"type": "integer", "minimum": meta["minimum"]}
    if meta.get("choices"):
        return {"enum": list(meta["choices"])}
    if meta.get("parts"):
        return {"type": "object", "additionalProperties": False,
                "properties": {part: {"enum": list(choices)} for part, choices in meta["parts"].items()}}
    if "parse" not in meta and meta.get("minimum") is not None:
        return {"type": "number", "minimum": meta["minimum"]}
    if name in _CUSTOM:
        return _CUSTOM[name]
    raise KeyError(f"no JSON Schema type for the {what} {name!r}: add it to schema.py's _CUSTOM")


def _fixed_field(name: str) -> dict:
    """The schema of one fixed trial field; a KeyError for a field without one."""
    if name not in TRIAL_FIELDS:
        raise KeyError(f"no JSON Schema type for the fixed field {name!r}: not a TrialConfig field")
    meta = TRIAL_FIELDS[name].metadata
    return _described(_value(meta, name, "fixed field"), meta)


def _param_value(name: str) -> dict:
    """The schema of one value a searched parameter may take."""
    param = sp.SEARCHED.get(name)
    if param is None:
        raise KeyError(f"no JSON Schema type for the searchable parameter {name!r}")
    if param.part:
        return {"enum": list(param.choices)}
    if name == "topology":     # searched topologies are scalars: XxYxZ or auto
        return _TOPOLOGY_TEXT
    return _value(param.meta, name, "searchable parameter")


def _param(name: str) -> dict:
    choices = {"type": "array", "items": _param_value(name), "minItems": 1, "uniqueItems": True}
    forms = [choices, {"type": "object", "additionalProperties": False, "required": ["choices"],
                       "properties": {"choices": choices}}]
    if name in sp.INT_PARAMS:
        forms.append({"type": "object", "additionalProperties": False, "required": ["low", "high"],
                      "properties": {"low": _param_value(name), "high": _param_value(name),
                                     "log": {"type": "boolean"}, "step": {"type": "integer", "minimum": 1}}})
    param = sp.SEARCHED[name]
    if param.part is None:
        description = param.meta["help"]
    elif name == param.part:
        description = f"the {name} layout of both phases"
    else:
        description = f"the {param.part} layout of the {param.field} phase"
    return {"oneOf": forms, "description": description}


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
        "retry_oom": {"type": "boolean",
                      "description": "also re-run a trial whose worker the kernel killed for memory"},
        "memory_budget_bytes": _QUANTITY,
        "resources": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0}},
        "verify": {"type": "boolean",
                   "description": "measured trials also run the unsharded reference"},
        "serving": {"type": "object",
                    "description": "the serving workload a plan is made for (rate or trace, "
                                   "input_len, output_len, ttft, tpot, ...)"},
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
            "description": "A search-space file of `sweeper run` (docs/space-files.md).",
            "type": "object", "additionalProperties": False, "required": ["model"],
            "properties": properties}
