"""Loading a recipe file: YAML with the line of every key, `${VAR}` interpolation,
validation against the schema, and `RecipeError`, whose issues name the line, the value
and the fix.

    load_recipe(path, env=None) -> Recipe      # parse_recipe(text, file, env): text in memory

Errors come all at once: YAML syntax, duplicate keys, interpolation, every field error
(with a "did you mean" for an unknown key or choice) and the cross-field problems the
schema's validators raise (`CrossFieldError`), each rendered as
`FILE:LINE: key.path = value: constraint and fix`. A recipe with field errors also gets
the cross-references of its valid parts checked (`_partial_problems`).
`${VAR}` and `${VAR:-default}` are interpolated from the environment into scalar values
before validation (`$${` writes a literal `${`).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from jetctl.recipe.checks import (
    MISSING,
    CrossFieldError,
    Problem,
    _deterministic_problems,
    _dotted,
    _model_refs,
    _recipe_problems,
    _show,
)
from jetctl.recipe.reference import _is_model, _unwrap, reference_fields
from jetctl.recipe.schema import ModelConfig, Recipe, TaskConfig

_M = TypeVar("_M", bound=BaseModel)
_Loc = tuple[str | int, ...]
_Key = tuple[str, ...]  # a loc with every part as str, to match YAML keys and indexes

# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class RecipeIssue:
    """One problem in a recipe file: where it is, what the value is, and the fix."""

    file: str
    line: int | None  # 1-based YAML line; None when the file could not be read
    path: str  # dotted key path, e.g. tasks.math.group_size ("" for the file as a whole)
    message: str  # the constraint broken and how to fix it
    value: object = None
    has_value: bool = False  # False for a missing key or a file-level problem

    def render(self) -> str:
        where = f"{self.file}:{self.line}" if self.line is not None else self.file
        what = self.path
        if self.has_value:
            what = f"{what} = {_show(self.value, self.path)}"
        return f"{where}: {what}: {self.message}" if what else f"{where}: {self.message}"


class RecipeError(Exception):
    """Every problem found in one recipe file, sorted by line."""

    def __init__(self, issues: list[RecipeIssue]) -> None:
        self.issues = sorted(issues, key=lambda i: (i.line is None, i.line or 0))
        super().__init__(self.render())

    def render(self) -> str:
        """One line per issue: `FILE:LINE: key.path = value: constraint and fix`."""
        return "\n".join(issue.render() for issue in self.issues)


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Recipe:
    """Read, interpolate and validate a recipe file; raise `RecipeError` with every issue.

    `env` defaults to `os.environ`.
    """
    file = os.fspath(path)
    try:
        text = Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([RecipeIssue(file, None, "", "file not found")]) from None
    except IsADirectoryError:
        raise RecipeError([RecipeIssue(file, None, "", "is a directory, not a file")]) from None
    except UnicodeDecodeError:
        raise RecipeError([RecipeIssue(file, None, "", "is not UTF-8 text")]) from None
    except OSError as err:
        raise RecipeError([RecipeIssue(file, None, "", err.strerror or str(err))]) from None
    return parse_recipe(text, file=file, env=env)


def parse_recipe(text: str, file: str = "<recipe>", env: Mapping[str, str] | None = None) -> Recipe:
    """`load_recipe` for YAML text already in memory; `file` is the name used in issues."""
    environ: Mapping[str, str] = os.environ if env is None else env
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise RecipeError(
                [RecipeIssue(file, 1, "", "the file is empty: a recipe needs models: and tasks:")]
            )
        prep = _Interpolator(loader, environ, file)
        prep.walk(root, ())
        data = loader.construct_document(root)
    except yaml.MarkedYAMLError as err:
        raise RecipeError([_syntax_issue(file, err)]) from None
    finally:
        loader.dispose()
    lines: dict[_Key, int] = {}
    _line_map(root, (), root.start_mark.line + 1, lines, set())
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        # a key with an interpolation problem is reported once, for that problem
        reported = {issue.path for issue in prep.issues}
        found = _issues(err, file, lines, prep.interpolated)
        if not any(error["loc"] == () for error in err.errors()):  # Recipe's check did not run
            found += _problem_issues(_partial_problems(data), (), file, lines, prep.interpolated)
        raise RecipeError(prep.issues + [i for i in found if i.path not in reported]) from None
    if prep.issues:
        raise RecipeError(prep.issues)
    return recipe


def _syntax_issue(file: str, err: yaml.MarkedYAMLError) -> RecipeIssue:
    mark = err.problem_mark or err.context_mark
    problem = err.problem or "invalid YAML"
    if err.context:
        problem = f"{err.context}, {problem}"
    if "\\t" in problem or "\t" in problem:
        problem += " (indent with spaces, not tabs)"
    elif "block" in problem:
        problem += " (check the indentation)"
    line = mark.line + 1 if mark is not None else None
    return RecipeIssue(file, line, "", f"YAML syntax error: {problem}")


def _partial_problems(data: object) -> list[Problem]:
    """`_recipe_problems` over the parts of a recipe that are valid on their own, so that
    a recipe with field errors also gets its cross-references checked in the same run."""
    if not isinstance(data, dict):
        return []
    models_raw, tasks_raw = data.get("models"), data.get("tasks")
    if not isinstance(models_raw, dict) or not isinstance(tasks_raw, dict):
        return []
    task_models = {
        str(name): _model_refs(task.get("model"), task.get("roles"))
        for name, task in tasks_raw.items()
        if isinstance(task, dict)
    }
    models = {str(k): m for k, v in models_raw.items() if (m := _valid(ModelConfig, v))}
    tasks = {str(k): t for k, v in tasks_raw.items() if (t := _valid(TaskConfig, v))}
    names = [str(name) for name in models_raw]
    run_raw = data.get("run")
    engine_default = ModelConfig.model_fields["engine"].default
    engines = {
        str(k): v.get("engine", engine_default) for k, v in models_raw.items() if isinstance(v, dict)
    }
    deterministic = run_raw.get("deterministic") if isinstance(run_raw, dict) else None
    return _recipe_problems(task_models, names, models, tasks) + _deterministic_problems(
        deterministic, engines
    )


def _valid(cls: type[_M], raw: object) -> _M | None:
    """`raw` validated as `cls`, or None when it has errors (they are reported already)."""
    try:
        return cls.model_validate(raw)
    except ValidationError:
        return None


_MERGE_TAG = "tag:yaml.org,2002:merge"
_REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_NAME_DEFAULT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?::-(.*))?$", re.DOTALL)


@dataclass
class _Interpolator:
    """Interpolates `${VAR}` in scalar values and flags duplicate keys, in place."""

    loader: yaml.SafeLoader
    environ: Mapping[str, str]
    file: str
    issues: list[RecipeIssue] = field(default_factory=list)
    interpolated: dict[_Key, str] = field(default_factory=dict)  # key path -> text as written
    visited: set[int] = field(default_factory=set)  # node ids (an alias shares its node)

    def walk(self, node: yaml.Node, path: _Key) -> None:
        if id(node) in self.visited:
            return
        self.visited.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    self.issues.append(
                        RecipeIssue(
                            self.file,
                            line,
                            _dotted((*path, key)),
                            f"duplicate key (first on line {seen[key]}); YAML would keep only "
                            "the last: remove one",
                        )
                    )
                seen.setdefault(key, line)
                self.walk(value_node, (*path, key))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self.walk(item, (*path, str(index)))
        elif isinstance(node, yaml.ScalarNode) and "${" in node.value:
            self._interpolate(node, path)

    def _interpolate(self, node: yaml.ScalarNode, path: _Key) -> None:
        raw: str = node.value
        line = node.start_mark.line + 1

        def substitute(match: re.Match[str]) -> str:
            if match.group(0) == "$${":
                return "${"
            ref = _NAME_DEFAULT.match(match.group(1))
            if ref is None:
                self.issues.append(
                    RecipeIssue(
                        self.file,
                        line,
                        _dotted(path),
                        f"malformed reference {match.group(0)}: write ${{NAME}} or "
                        "${NAME:-default}, or $${ for a literal ${",
                        raw,
                        True,
                    )
                )
                return match.group(0)
            name, default = ref.group(1), ref.group(2)
            value = self.environ.get(name)
            if default is not None and not value:  # like the shell: unset or empty
                return default
            if value is None:
                self.issues.append(
                    RecipeIssue(
                        self.file,
                        line,
                        _dotted(path),
                        f"environment variable {name} is not set: export {name}=... "
                        f"or write ${{{name}:-default}}",
                    )
                )
                return match.group(0)
            return value

        node.value = _REFERENCE.sub(substitute, raw)
        self.interpolated[path] = raw
        if node.style is None:  # a plain scalar: type it as if the value had been written
            node.tag = self.loader.resolve(yaml.ScalarNode, node.value, (True, False))


def _line_map(
    node: yaml.Node, path: _Key, line: int, lines: dict[_Key, int], ancestors: set[int]
) -> None:
    """Record the 1-based line of every key path (a key's line, or a list item's)."""
    lines[path] = line
    if id(node) in ancestors:  # a recursive alias
        return
    ancestors = ancestors | {id(node)}
    if isinstance(node, yaml.MappingNode):
        # the last of duplicate keys is the one YAML keeps
        last = {str(k.value): (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}
        for key, (key_node, value_node) in last.items():
            key_line = key_node.start_mark.line + 1
            _line_map(value_node, (*path, key), key_line, lines, ancestors)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            item_line = item.start_mark.line + 1
            _line_map(item, (*path, str(index)), item_line, lines, ancestors)


def _line_for(loc: _Loc, lines: dict[_Key, int]) -> int | None:
    key: _Key = tuple(str(part) for part in loc)
    while key not in lines and key:
        key = key[:-1]
    return lines.get(key)


# --------------------------------------------------------------------------- messages

_WHY: dict[tuple[str, str], str] = {
    ("TaskConfig", "group_size"): "GRPO needs at least two rollouts per group",
    ("TaskConfig", "clients"): "0 starts no client node for this task",
    ("LoraConfig", "dropout"): "a probability",
    ("SamplingConfig", "top_p"): "a probability mass",
    ("ModelConfig", "port"): "0 picks a free port",
    ("ModelConfig", "metrics_port"): "0 picks a free port",
    ("TrainConfig", "max_staleness"): "0 accepts only groups made by the current weights",
}
_BOUNDS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}
_TYPES = {
    "int_parsing": "must be an integer",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_parsing": "must be a number",
    "float_type": "must be a number",
    "bool_parsing": "must be true or false",
    "bool_type": "must be true or false",
    "dict_type": "must be a mapping of key: value lines",
    "model_type": "must be a mapping of key: value lines",
    "model_attributes_type": "must be a mapping of key: value lines",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
}


def _issues(
    err: ValidationError, file: str, lines: dict[_Key, int], interpolated: dict[_Key, str]
) -> list[RecipeIssue]:
    issues: list[RecipeIssue] = []
    for error in err.errors():
        loc: _Loc = tuple(part for part in error["loc"] if part != "[key]")
        ctx: dict[str, Any] = error.get("ctx") or {}
        cause = ctx.get("error")
        if isinstance(cause, CrossFieldError):
            issues += _problem_issues(cause.problems, loc, file, lines, interpolated)
            continue
        message = _describe(error["type"], loc, ctx, error["input"], error["msg"])
        missing = error["type"] == "missing"
        issues.append(
            RecipeIssue(
                file,
                _line_for(loc, lines),
                _dotted(loc),
                _with_source(message, loc, interpolated),
                None if missing else error["input"],
                not missing and bool(loc),
            )
        )
    return issues


def _problem_issues(
    problems: list[Problem],
    at: _Loc,
    file: str,
    lines: dict[_Key, int],
    interpolated: dict[_Key, str],
) -> list[RecipeIssue]:
    issues = []
    for problem in problems:
        loc = (*at, *problem.loc)
        message = _with_source(problem.message, loc, interpolated)
        issues.append(
            RecipeIssue(
                file, _line_for(loc, lines), _dotted(loc), message,
                None if problem.value is MISSING else problem.value, problem.value is not MISSING,
            )
        )
    return issues


def _describe(kind: str, loc: _Loc, ctx: dict[str, Any], value: object, msg: str) -> str:
    owner = _model_at(loc[:-1]) if loc else None
    key = str(loc[-1]) if loc else ""
    why = _WHY.get((owner.__name__, key)) if owner is not None else None
    if kind == "extra_forbidden" and owner is not None:
        return _unknown_key(key, owner, loc[:-1])
    if kind == "missing":
        if isinstance(loc[-1], int):
            return f"item {loc[-1]} is missing"
        info = owner.model_fields.get(key) if owner is not None else None
        desc = f": {info.description}" if info is not None and info.description else ""
        return f"required key is missing; add it{desc}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        text = f"must be {_BOUNDS[kind]} {bound}"
        return f"{text} ({why})" if why else text
    if kind == "literal_error":
        info = owner.model_fields.get(key) if owner is not None else None
        choices = _literal_choices(info.annotation) if info is not None else []
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"must be one of {ctx['expected']}{hint}"
    if kind == "value_error":
        return str(ctx.get("error", msg))
    if kind == "string_type":
        if not loc:
            return "a recipe must be a mapping with run:, models: and tasks:"
        if isinstance(value, (int, float, bool)):
            return f"must be a string: YAML read a {type(value).__name__}, so quote it"
        return "must be a string"
    if kind in _TYPES:
        if not loc:
            return "a recipe must be a mapping with run:, models: and tasks:"
        return _TYPES[kind]
    return msg[:1].lower() + msg[1:]


def _literal_choices(annotation: Any) -> list[str]:
    """The values of a Literal field (of the Literal inside `Literal[...] | None` too)."""
    if get_origin(annotation) is Literal:
        return [str(c) for c in get_args(annotation)]
    return [c for arg in get_args(annotation) for c in _literal_choices(arg)]


def _unknown_key(key: str, owner: type[BaseModel], parent: _Loc) -> str:
    """A suggestion for a key `owner` does not have: the same key where it does belong,
    else the closest key of `owner`, else the list of `owner`'s keys."""
    homes = [
        doc.path.rsplit(".", 1)[0] for doc in reference_fields() if doc.path.endswith(f".{key}")
    ]
    if homes:
        return f"unknown key here; {key} belongs under {' or '.join(homes)}"
    known = list(owner.model_fields)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    where = _dotted(parent) or "the top level"
    return f"unknown key; keys of {where} are: {', '.join(known)}"


def _with_source(message: str, loc: _Loc, interpolated: dict[_Key, str]) -> str:
    raw = interpolated.get(tuple(str(part) for part in loc))
    return f"{message} (value from {raw})" if raw is not None else message


# --------------------------------------------------------------------------- schema walk


def _model_at(loc: _Loc) -> type[BaseModel] | None:
    """The schema model whose fields sit at `loc` (dict keys and list indexes skipped)."""
    tp: Any = Recipe
    for part in loc:
        tp = _unwrap(tp)
        if _is_model(tp):
            info = tp.model_fields.get(str(part))
            if info is None:
                return None
            tp = info.annotation
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1]
        elif get_origin(tp) in (list, tuple):
            tp = get_args(tp)[0]
        else:
            return None
    tp = _unwrap(tp)
    return tp if _is_model(tp) else None
