"""Cross-field checks: one field against another (or against the host), each problem found
reported as a `Problem` with its key (relative to the model that checks it), the value and
the fix.

Cross-field checks (e.g. `concurrency` vs `group_size`) live in `model_validator`s on the
smallest model that holds both fields (schema.py); the longer ones are the functions here,
which those validators call. They run once that model's own fields are valid, so a recipe
with type errors reports those first and its cross-field problems on the next run, as
pydantic does. A validator raises `CrossFieldError` with every problem it found, and the
loader (loading.py) reports each at its own key and YAML line.

Also here: how a key path and a value are written in a message (`_dotted`, `_show`), which
the loader's messages share.

This module imports no other part of jetctl.recipe (the models appear in annotations
only), so that schema.py can import it.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, NamedTuple

from jetctl.deterministic import SEEDED_ENGINES

if TYPE_CHECKING:
    from jetctl.recipe.schema import EvalConfig, ModelConfig, TaskConfig, TrainConfig

DATASET_ENV = "jetctl.envs.dataset:make_env"

# --------------------------------------------------------------------------- problems


class _Missing:
    """The value of a Problem about a key that is not there (shown without a value)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class Problem(NamedTuple):
    """One cross-field problem found by a validator; `loc` is relative to its model."""

    loc: tuple[str | int, ...]
    value: object
    message: str


class CrossFieldError(ValueError):
    """Raised by model validators with every problem they found, so each keeps its key.

    pydantic wraps it as a `value_error` whose `ctx["error"]` is this object; the loader
    prefixes each problem's `loc` with the error's and so reports the exact YAML line.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__(
            "; ".join(f"{_dotted(p.loc)} = {_show(p.value)}: {p.message}" for p in problems)
        )


def _raise_problems(problems: list[Problem]) -> None:
    if problems:
        raise CrossFieldError(problems)


# --------------------------------------------------------------------------- checks


def checkpoint_url_problem(url: str, packages: bool = True) -> str:
    """Why `checkpoint.dir` cannot be written ('' when it can): an fsspec URL whose scheme is
    unknown or whose filesystem package is missing (`packages`: on this host), or one that
    would not outlive the server."""
    if "://" not in url:
        return ""  # a local folder
    scheme = url.split("://", 1)[0]
    if scheme == "memory":
        return (
            "memory:// lives only inside the server process, so a restarted server would find "
            "no checkpoint: use a folder or a durable URL (file://, s3://, ...)"
        )
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        return f"unknown filesystem {scheme!r}: use a folder or an fsspec URL (file://, s3://, ...)"
    except ImportError as err:
        if not packages:
            return ""
        return f"the {scheme}:// filesystem needs a package that is not installed ({err}); or use a folder"
    return ""


def server_host_problems(cfg: ModelConfig) -> list[Problem]:
    """What the host that runs this model's server must have installed: checked by
    `jetctl validate` and `up` for a server they start here (runtime: process), and by the
    server itself when it starts elsewhere (runtime: ray or external), on its own host."""
    problems: list[Problem] = []
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(
            Problem(
                ("engine",),
                cfg.engine,
                "needs the vllm package, which is not importable on the server's host: run "
                "`pip install vllm` on a CUDA machine, or use engine: hf",
            )
        )
    if cfg.checkpoint.dir is not None:
        problem = checkpoint_url_problem(cfg.checkpoint.dir)
        if problem:
            problems.append(Problem(("checkpoint", "dir"), cfg.checkpoint.dir, problem))
    return problems


def _deterministic_problems(deterministic: object, engines: Mapping[str, object]) -> list[Problem]:
    """run.deterministic: every model's engine (`engines`: model -> engine) must honour a
    request's seed."""
    if deterministic is not True:
        return []
    return [
        Problem(
            ("models", name, "engine"),
            engine,
            f"is not an engine whose seeded replies repeat, which run.deterministic: true "
            f"needs (vllm takes the seed, but its replies change with the batch they ran "
            f"in): use engine: {' or '.join(SEEDED_ENGINES)}, or set run.deterministic: false",
        )
        for name, engine in engines.items()
        if engine not in SEEDED_ENGINES
    ]


def _model_refs(model: object, roles: object) -> list[tuple[tuple[str, ...], str]]:
    """Where a task names models: [(key path inside the task, model key)]."""
    refs: list[tuple[tuple[str, ...], str]] = []
    if isinstance(model, str):
        refs.append((("model",), model))
    if isinstance(roles, dict):
        refs += [(("roles", str(r)), m) for r, m in roles.items() if isinstance(m, str)]
    return refs


def _recipe_problems(
    task_models: Mapping[str, list[tuple[tuple[str, ...], str]]],
    model_names: Collection[str],
    models: Mapping[str, ModelConfig],
    tasks: Mapping[str, TaskConfig],
) -> list[Problem]:
    """Checks across models and tasks. `task_models` maps each task to where it names models
    (its `model:` or each of its `roles:`, see `_model_refs`) and `model_names` holds every
    key of models; `models` and `tasks` hold the valid ones (all of them, unless the loader
    is checking a recipe with field errors)."""
    problems: list[Problem] = []
    if not model_names:
        problems.append(
            Problem(("models",), {}, "names no model: add one, e.g. policy: {model: ...}")
        )
    known = ", ".join(sorted(model_names)) or "(none)"
    for name, refs in task_models.items():
        for at, model_key in refs:
            for p in _task_model_problems(name, at, model_key, model_names, known, models, tasks):
                if p not in problems:  # two roles on models with the same caps: once
                    problems.append(p)
    problems += _mix_problems(models, tasks)
    problems += _eval_step_problems(models, tasks)
    folders: dict[str, str] = {}  # checkpoint.dir -> the first model that names it
    for name, model in models.items():
        folder = model.checkpoint.dir
        if folder is None:
            continue  # <run dir>/checkpoints/<model>: a folder of its own
        first = folders.setdefault(folder.rstrip("/"), name)
        if first != name:
            problems.append(
                Problem(
                    ("models", name, "checkpoint", "dir"),
                    folder,
                    f"is also models.{first}.checkpoint.dir: two models' steps would mix in "
                    "one folder; give each model its own folder, or leave it unset "
                    "(<run dir>/checkpoints/<model>)",
                )
            )
    taken: dict[tuple[str, int], str] = {}
    for name, model in models.items():
        for key in ("port", "metrics_port"):
            port: int = getattr(model, key)
            where = f"models.{name}.{key}"
            other = taken.setdefault((model.host, port), where) if port else where
            if other != where:
                problems.append(
                    Problem(
                        ("models", name, key),
                        port,
                        f"is already used by {other}: use another port, or 0 to pick one",
                    )
                )
    return problems


def _algorithm_problems(train: TrainConfig) -> list[Problem]:
    """Clip settings the chosen algorithm would not read are refused, not ignored."""
    problems: list[Problem] = []
    if train.clip_eps_high is not None and train.algorithm != "dapo":
        problems.append(Problem(
            ("train", "clip_eps_high"), train.clip_eps_high,
            f"only applies with algorithm: dapo (its decoupled upper clip range; "
            f"{train.algorithm} clips to [1 - clip_eps, 1 + clip_eps]): remove it or set "
            "algorithm: dapo",
        ))
    if train.algorithm == "gspo" and "clip_eps" in train.model_fields_set:
        problems.append(Problem(
            ("train", "clip_eps"), train.clip_eps,
            "gspo clips its sequence-level ratio to its own range [1 - 3e-4, 1 + 4e-4] "
            "(Zheng et al. 2025); clip_eps is the token ratio's range of grpo, dr_grpo, dapo "
            "and rloo: remove it",
        ))
    return problems


def _mix_problems(
    models: Mapping[str, ModelConfig], tasks: Mapping[str, TaskConfig]
) -> list[Problem]:
    """Each model's `train.mix` names exactly the tasks that train it."""
    problems: list[Problem] = []
    for name, model in models.items():
        mix = model.train.mix
        if not mix:
            continue
        training = [t for t, c in tasks.items() if name in c.models]
        for task in mix:
            if task not in training:
                close = difflib.get_close_matches(task, training, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(Problem(
                    ("models", name, "train", "mix", task), mix[task],
                    f"{task!r} is not a task that trains {name} (those: "
                    f"{', '.join(training) or 'none'}){hint}",
                ))
        missing = [t for t in training if t not in mix]
        if missing:
            problems.append(Problem(
                ("models", name, "train", "mix"), mix,
                f"gives no share to {', '.join(missing)}, which train(s) {name}: give every "
                "task of this model a share",
            ))
    return problems


def _task_eval_problems(task: TaskConfig, block: EvalConfig) -> list[Problem]:
    """An eval scores fixed rows of one model: a dataset task, with held-out rows."""
    if not task.env.startswith(DATASET_ENV.split(":")[0] + ":"):
        return [Problem(
            ("eval",), block.model_dump(exclude_defaults=True),
            f"needs a dataset task (env: {DATASET_ENV}), whose rows can be held out; "
            f"{task.env} has none: remove eval:, and score this task your own way",
        )]
    problems: list[Problem] = []
    if task.roles:
        problems.append(Problem(
            ("eval",), block.model_dump(exclude_defaults=True),
            "scores one model, and this team task trains several (roles:): remove eval:, "
            "or give the task one model:",
        ))
    held_out = task.env_args.get("test_fraction") or task.env_args.get("test_path")
    if block.split == "test" and not held_out:
        problems.append(Problem(
            ("eval", "split"), block.split,
            "needs held-out rows, and env_args has neither test_fraction nor test_path: "
            "add env_args.test_fraction (e.g. 0.2) or env_args.test_path, or set split: "
            "train",
        ))
    return problems


def _eval_step_problems(
    models: Mapping[str, ModelConfig], tasks: Mapping[str, TaskConfig]
) -> list[Problem]:
    """A task's `eval.every_steps` falls on its model's checkpoints (the eval loads one),
    and its model's server runs where the run dir's recipe and data are (runtime: process)."""
    problems: list[Problem] = []
    for name, task in tasks.items():
        if task.eval is None:
            continue
        problems += [Problem(("tasks", name, *p.loc), p.value, p.message)
                     for p in _task_eval_problems(task, task.eval)]
        if task.model is None or task.model not in models:  # a team: refused above
            continue
        model = models[task.model]
        every, ckpt = task.eval.every_steps, model.checkpoint.every_steps
        if every % ckpt:
            up = -(-every // ckpt) * ckpt
            problems.append(Problem(
                ("tasks", name, "eval", "every_steps"), every,
                f"is not a multiple of models.{task.model}.checkpoint.every_steps ({ckpt}), "
                f"so no checkpoint would be there to evaluate: use {up} (or another multiple "
                f"of {ckpt}), or change checkpoint.every_steps",
            ))
        if model.runtime != "process":
            problems.append(Problem(
                ("tasks", name, "eval"), task.eval.model_dump(exclude_defaults=True),
                f"runs beside models.{task.model}'s server, reading the run dir's recipe and "
                f"the dataset, which a server with runtime: {model.runtime} does not have: "
                "remove eval: and run `jetctl eval RUN_DIR` on this host",
            ))
    return problems


def _task_model_problems(
    name: str,
    at: tuple[str, ...],
    model_key: str,
    model_names: Collection[str],
    known: str,
    models: Mapping[str, ModelConfig],
    tasks: Mapping[str, TaskConfig],
) -> list[Problem]:
    """A task's reference to one model: the key exists, and the task's sampling fits it."""
    if model_key not in model_names:
        close = difflib.get_close_matches(model_key, list(model_names), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return [
            Problem(
                ("tasks", name, *at),
                model_key,
                f"is not a key of models: use one of {known}{hint}",
            )
        ]
    if name not in tasks or model_key not in models:
        return []
    cap = models[model_key].generation.max_new_tokens
    context = models[model_key].generation.max_context_tokens
    wanted = tasks[name].sampling.max_tokens
    if wanted >= context:
        return [
            Problem(
                ("tasks", name, "sampling", "max_tokens"),
                wanted,
                f"leaves no room for the prompt in models.{model_key}.generation."
                f"max_context_tokens ({context}), so the server would refuse every "
                f"request: lower max_tokens well below {context}",
            )
        ]
    if wanted > cap:
        return [
            Problem(
                ("tasks", name, "sampling", "max_tokens"),
                wanted,
                f"exceeds models.{model_key}.generation.max_new_tokens ({cap}), the "
                f"server's cap on any request: lower max_tokens to {cap} or raise "
                "max_new_tokens",
            )
        ]
    return []


# ------------------------------------------------------- keys and values in messages


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_SECRET_KEYS = ("token", "secret", "password", "api_key", "apikey")


def _show(value: object, path: str = "") -> str:
    """A value as the user would recognise it in YAML, short; secrets masked."""
    if any(path.lower().endswith(key) for key in _SECRET_KEYS) and value:
        return "'***'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
