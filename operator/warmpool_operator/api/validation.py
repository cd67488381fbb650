"""How the WarmModel API validates: every cross-field rule written once as a :class:`Rule`, its
CEL expression for the API server (``x-kubernetes-validations``) beside its Python twin, which
runs when the operator parses a spec; and :class:`ApiObject`, the strict camelCase base of
every type in :mod:`warmpool_operator.api.types`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class Rule:
    """One validation rule, written twice side by side so the two stay in step.

    ``cel`` runs in the API server (``x-kubernetes-validations``); ``check`` is its Python
    twin, run on the parsed model.  ``field_path`` (relative, e.g. ``.pauseAtPercent``) is
    where the API server reports the error; ``message`` names the field in API terms.
    """

    cel: str
    message: str
    check: Callable[[Any], bool]
    field_path: str | None = None

    def to_schema(self) -> dict[str, Any]:
        rule: dict[str, Any] = {"rule": self.cel, "message": self.message}
        if self.field_path:
            rule["fieldPath"] = self.field_path
        return rule


def immutable(api_path: str) -> dict[str, Any]:
    """Schema extras for a field that may be set at creation but never changed."""
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{api_path} is immutable"}]}


def _add_rules(schema: dict[str, Any], cls: type[Any]) -> None:
    """Put a model's rules into its JSON schema (pydantic calls this while generating)."""
    rules: tuple[Rule, ...] = getattr(cls, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [rule.to_schema() for rule in rules]


class ApiObject(BaseModel):
    """Base of every object in the WarmModel API."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        # Strict like the API server: a string is not an integer, "yes" is not a boolean.
        strict=True,
        # The API server prunes or (kubectl's strict field validation) refuses unknown fields.
        extra="forbid",
        use_attribute_docstrings=True,
        json_schema_extra=_add_rules,
    )

    #: Cross-field rules of this object (see :class:`Rule`).
    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self) -> Self:
        for rule in type(self).cel_rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self
