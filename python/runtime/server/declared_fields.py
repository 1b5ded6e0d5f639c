"""Request-body fields built from the one sampling declaration (radixgen.common.sampling_params).

A protocol's body (native /generate's `sampling_params`, the OpenAI bodies) takes every declared parameter it
exposes under its own spelling, typed as JSON carries it (the declaration's wire type), None meaning "the
declared default"; each value is checked by the declaration's own range check (`check_param`), per field, so
a 400 names the field. A protocol adds only what its API says differently: a spelling, a default, a narrower
bound of its own (OpenAI's temperature in [0, 2]).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationInfo, create_model, field_validator

from radixgen.common.sampling_params import param_error, sampling_fields, wire_type


def declared_body(name: str, base: type, *, doc: str, spelling: dict[str, str] | None = None,
                  exclude: frozenset[str] | set[str] = frozenset(), defaults: dict[str, Any] | None = None,
                  limits: dict[str, dict[str, Any]] | None = None) -> Any:
    """A pydantic model `name` deriving from `base`: a field per declared parameter not in `exclude` (spelled
    `spelling.get(p, p)`; `defaults` / `limits`: a protocol's own default and pydantic bounds, by declared
    name), each checked against its declaration."""
    spelling, defaults, limits = spelling or {}, defaults or {}, limits or {}
    fields: dict[str, Any] = {}
    declared_of: dict[str, str] = {}  # the body's spelling -> the declared name
    for f in sampling_fields():
        if f.name in exclude:
            continue
        wire = spelling.get(f.name, f.name)
        declared_of[wire] = f.name
        fields[wire] = (wire_type(f.name) | None, Field(defaults.get(f.name), **limits.get(f.name, {})))

    def check(cls: type, value: Any, info: ValidationInfo) -> Any:
        why = None if value is None else param_error(declared_of[info.field_name], value)
        if why is not None:
            raise ValueError(why)
        return value

    validators = {"_declared_ranges": field_validator(*declared_of)(classmethod(check))} if declared_of else {}
    model = create_model(name, __base__=base, __module__=base.__module__, __validators__=validators, **fields)
    model.__doc__ = doc
    model.declared_names = declared_of  # the body's spelling -> the declared parameter
    return model


def declared_check(field: str, declared: str | None = None) -> Any:
    """A pydantic validator for a body's own field that carries a declared parameter (`declared`, default the
    field's name): the declaration's range check, so a 400 names the field."""

    def check(cls: type, value: Any) -> Any:
        why = None if value is None else param_error(declared or field, value)
        if why is not None:
            raise ValueError(why)
        return value

    return field_validator(field)(classmethod(check))
