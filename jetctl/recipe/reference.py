"""The field reference of docs/recipe.md, generated from the schema: every leaf field
(`reference_fields`) with its type and bounds, its default and its description, as one
Markdown table.

    python -m jetctl.recipe --write-docs docs/recipe.md   # rewrite the table between the marks
    python -m jetctl.recipe                               # print it

tests/test_recipe.py fails when docs/recipe.md's table is stale. The notes an error message
adds to a bound (`_WHY`) belong to the messages, in loading.py.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from jetctl.recipe.schema import Recipe

# --------------------------------------------------------------------------- schema walk


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [arg for arg in get_args(tp) if arg is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


class FieldDoc(NamedTuple):
    path: str  # dotted; dict keys appear as <name>
    type: str
    default: str  # "required" or the YAML of the default
    description: str


def reference_fields(model: type[BaseModel] = Recipe, prefix: str = "") -> Iterator[FieldDoc]:
    """Every leaf field of the schema, in declaration order."""
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        tp = _unwrap(info.annotation)
        if _is_model(tp):
            yield from reference_fields(tp, path)
        elif get_origin(tp) is dict and _is_model(get_args(tp)[1]):
            yield from reference_fields(get_args(tp)[1], f"{path}.<name>")
        else:
            yield FieldDoc(
                path,
                _type_name(info.annotation, info.metadata),
                _default(info.default),
                info.description or "",
            )


def _type_name(tp: Any, metadata: list[Any]) -> str:
    if get_origin(tp) is Literal:
        text = " \\| ".join(str(arg) for arg in get_args(tp))
    elif get_origin(tp) in (Union, types.UnionType):
        text = " \\| ".join(_type_name(arg, []) for arg in get_args(tp))
    elif get_origin(tp) is not None:
        args = ", ".join(_type_name(arg, []) for arg in get_args(tp))
        text = f"{get_origin(tp).__name__}[{args}]"
    elif tp is type(None):
        text = "null"
    else:
        text = getattr(tp, "__name__", str(tp))
    bounds = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                bounds.append(f"{sign} {getattr(item, attr)}")
    return f"{text}, {', '.join(bounds)}" if bounds else text


def _default(value: object) -> str:
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...")
    return f"`{text.strip()}`"


def reference_markdown() -> str:
    """The field table of docs/recipe.md, generated from the schema."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for doc in reference_fields():
        meaning = doc.description.replace("|", "\\|").replace("<", "\\<")
        rows.append(f"| `{doc.path}` | {doc.type} | {doc.default} | {meaning} |")
    return "\n".join(rows) + "\n"


BEGIN_MARK = "<!-- BEGIN GENERATED: python -m jetctl.recipe --write-docs docs/recipe.md -->"
END_MARK = "<!-- END GENERATED -->"


def write_reference(doc: Path) -> None:
    """Replace the generated table of `doc` (between the markers) with a fresh one."""
    text = doc.read_text(encoding="utf-8")
    head, rest = text.split(BEGIN_MARK, 1)
    _, tail = rest.split(END_MARK, 1)
    doc.write_text(f"{head}{BEGIN_MARK}\n{reference_markdown()}{END_MARK}{tail}", encoding="utf-8")
