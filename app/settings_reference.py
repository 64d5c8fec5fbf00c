"""The settings reference, made from ``Settings`` itself: each setting's variable, type,
default and description (its field's docstring). The documentation's settings page is built
from it (``docs/hooks.py``), so that the reference cannot drift from the code.

``python -m app.settings_reference`` prints it.
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo

from app.settings import ENV_PREFIX, Settings

MARKER = "<!-- settings-reference -->"


def type_name(annotation: Any) -> str:
    """A type as a reader needs it: the choices of a ``Literal``, ``optional`` for ``| None``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return " or ".join(type_name(kind) for kind in kinds) + " (optional)"
    if origin is tuple:
        return "comma-separated list"
    if isinstance(annotation, type):
        if issubclass(annotation, Path):
            return "path"
        if issubclass(annotation, enum.Enum):
            return " \\| ".join(f"`{member.value}`" for member in annotation)
        return {"SecretStr": "secret"}.get(annotation.__name__, annotation.__name__)
    return str(annotation)


def default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None or value == ():
        return "—"
    if isinstance(value, Path):
        home = str(Path.home())
        text = str(value)
        return f"`~{text[len(home) :]}`" if text.startswith(home) else f"`{text}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def reference() -> str:
    """Every setting as a Markdown table, in the order ``Settings`` declares them."""
    rows = ["| setting | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        description = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {type_name(field.annotation)} | "
                    f"{default_text(field)} | {description} |")  # fmt: skip
    return "\n".join(rows)


def undocumented() -> list[str]:
    """Settings without a description (the documentation build refuses them)."""
    return [name for name, field in Settings.model_fields.items() if not field.description]


if __name__ == "__main__":
    print(reference())
