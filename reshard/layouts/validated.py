"""A pydantic model that cannot be made invalid: `model_construct` and `model_copy(update=...)` validate through the
constructor, setting or deleting a field is refused, and pydantic's ValidationError becomes the library's error."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, ClassVar, Iterator

from pydantic import BaseModel, ValidationError

from ..errors import ArgumentError, from_validation


@contextmanager
def _library_errors(model: type) -> Iterator[None]:
    """pydantic's ValidationError raised inside, as the library's error for what `model` is."""
    try:
        yield
    except ValidationError as exc:
        raise from_validation(exc, getattr(model, "engine", None) or model.error_where) from None


class ValidatedModel(BaseModel):
    """Every way in validates; errors are the library's (`error_where`, or a layout's `engine`, names the model)."""

    error_where: ClassVar[str] = "model"

    def __init__(self, **data: Any) -> None:
        with _library_errors(type(self)):
            super().__init__(**data)

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        with _library_errors(cls):
            return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """From JSON text: an object at the top, strictly validated (a list, a string or a number is refused)."""
        if not isinstance(json_data, (str, bytes, bytearray)):
            raise ArgumentError("json_data", json_data, "must be JSON text (str or bytes)")
        with _library_errors(cls):
            return super().model_validate_json(json_data, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        with _library_errors(cls):
            return super().model_validate_strings(obj, **kwargs)

    @classmethod
    def model_construct(cls, _fields_set: Any = None, **values: Any) -> Any:  # type: ignore[override]
        """Validated like the constructor (pydantic's skips validation; an unvalidated instance is refused)."""
        return cls(**values)

    def model_copy(self, *, update: Any = None, deep: bool = False) -> Any:  # type: ignore[override]
        """A copy with `update` applied, validated; fields left to their defaults default again."""
        if update is not None and not isinstance(update, dict):
            raise ArgumentError("update", update, "must be a dict of field -> value, or None")
        if not isinstance(deep, bool):
            raise ArgumentError("deep", deep, "must be a bool")
        unknown = sorted(str(k) for k in (update or {}) if k not in type(self).model_fields)
        if unknown:
            raise ArgumentError("update", update, f"names fields {type(self).__name__} does not have: {unknown}")
        return type(self)(**{**{k: getattr(self, k) for k in self.model_fields_set}, **(update or {})})

    def __setattr__(self, name: str, value: Any) -> None:
        raise ArgumentError(name, value, f"cannot be set: a {type(self).__name__} is immutable (make another, or "
                                         f"model_copy(update={{...}}), which validates)")

    def __delattr__(self, name: str) -> None:
        raise ArgumentError(name, rule=f"cannot be deleted: a {type(self).__name__} is immutable")


__all__ = ["ValidatedModel"]
