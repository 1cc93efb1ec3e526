"""Recipe loading: every shipped recipe validates; errors come all at once with their
YAML line, value and fix; `${VAR}` interpolation; `jetctl validate` output and exit code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetctl.cli.main import build_app
from jetctl.recipe import (
    BEGIN_MARK,
    END_MARK,
    Recipe,
    RecipeError,
    load_recipe,
    parse_recipe,
    reference_markdown,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))

GOOD = """\
run:
  name: t
models:
  policy:
    model: builtin:tiny
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
"""


def issues_of(text: str, env: dict[str, str] | None = None) -> list[tuple[int | None, str, str]]:
    """(line, key path, rendered line) of every issue `text` has."""
    with pytest.raises(RecipeError) as caught:
        parse_recipe(text, file="r.yaml", env=env or {})
    return [(i.line, i.path, i.render()) for i in caught.value.issues]


def test_there_are_recipes() -> None:
    names = {path.name for path in RECIPES}
    assert {"quickstart.yaml", "tiny.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_validates_and_is_headed_by_its_command(path: Path) -> None:
    recipe = load_recipe(path, env={})
    assert recipe.models and recipe.tasks
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert re.fullmatch(rf"# jetctl \S+ recipes/{re.escape(path.name)}.*", first), first


def test_quickstart_is_what_the_docs_promise() -> None:
    recipe = load_recipe(ROOT / "recipes" / "quickstart.yaml", env={})
    policy, task = recipe.models["policy"], recipe.tasks["arithmetic"]
    assert recipe.run.name == "quickstart" and recipe.run.duration_s == 360
    assert task.env_args == {"max_turns": 1}, "one answer per question"
    two = load_recipe(ROOT / "recipes" / "arithmetic-two-turns.yaml", env={})
    assert two.tasks["arithmetic"].env_args == {"max_turns": 2}
    assert two.models["policy"] == policy, "the same model, trainer and engine settings"
    assert policy.model == "builtin:smollm2-135m-instruct" and policy.finetune == "lora"
    assert policy.lora.r == 16 and policy.optimizer.lr == pytest.approx(5e-4)
    assert policy.dtype == "float32" and policy.generation.dtype == "auto"
    # the freshest groups first, none more than a version old (issue 23's ablation)
    assert (policy.train.max_staleness, policy.train.order) == (1, "newest")
    assert (task.clients, task.group_size, task.concurrency, task.sampling.max_tokens) == (
        2,
        8,
        "auto",
        24,
    )


def test_tiny_is_what_the_tests_expect() -> None:
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", env={})
    policy, task = recipe.models["policy"], recipe.tasks["digits"]
    assert policy.model == "builtin:tiny" and policy.finetune == "full"
    assert policy.optimizer.lr == pytest.approx(2e-3)
    assert (policy.train.groups_per_step, policy.train.max_staleness) == (2, 2)
    assert policy.checkpoint.every_steps == 20
    assert (task.clients, task.group_size, task.sampling.max_tokens) == (2, 8, 4)


def test_three_planted_errors_are_all_reported_with_their_lines() -> None:
    text = """\
models:
  policy:
    model: builtin:tiny
    optimizer:
      lr: -0.1
tasks:
  math:
    env: envs.arithmetic:make_env
    agent: agents.arithmetic:agent
    model: policy
    group_size: 1
    clients: two
"""
    found = issues_of(text)
    assert [(line, path) for line, path, _ in found] == [
        (5, "models.policy.optimizer.lr"),
        (11, "tasks.math.group_size"),
        (12, "tasks.math.clients"),
    ]
    rendered = [r for _, _, r in found]
    assert rendered[0] == "r.yaml:5: models.policy.optimizer.lr = -0.1: must be > 0.0"
    assert rendered[1] == (
        "r.yaml:11: tasks.math.group_size = 1: must be >= 2 "
        "(GRPO needs at least two rollouts per group)"
    )
    assert rendered[2] == "r.yaml:12: tasks.math.clients = 'two': must be an integer"


def test_unknown_key_suggests_the_closest_known_key() -> None:
    text = GOOD + "    grup_size: 4\n"
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (11, "tasks.digits.grup_size")
    assert "did you mean 'group_size'?" in rendered


def test_known_key_in_the_wrong_place_says_where_it_belongs() -> None:
    text = GOOD.replace("    model: builtin:tiny\n", "    model: builtin:tiny\n    lr: 0.1\n")
    [(line, _, rendered)] = issues_of(text)
    assert line == 6 and "belongs under models.<name>.optimizer" in rendered


def test_missing_required_key_points_at_its_parent() -> None:
    text = GOOD.replace("    agent: agents.digits:agent\n", "")
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (7, "tasks.digits.agent")
    assert "required key is missing" in rendered and "module:function" in rendered


def test_unknown_model_of_a_task_points_at_its_model_key() -> None:
    text = GOOD.replace("    model: policy\n", "    model: polcy\n")
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (10, "tasks.digits.model")
    assert "use one of policy; did you mean 'policy'?" in rendered


TEAM = """\
models:
  planner:
    model: builtin:tiny
  coder:
    model: builtin:tiny
    generation: {max_new_tokens: 128}
tasks:
  team:
    env: envs.digits.team:make_env
    agent: agents.digits:team_agent
    roles:
      plan: planner
      code: coder
"""


def test_a_team_names_its_models_under_roles() -> None:
    team = parse_recipe(TEAM, env={}).tasks["team"]
    assert team.role_models == {"plan": "planner", "code": "coder"}
    assert team.models == ["planner", "coder"] and team.model is None
    assert parse_recipe(GOOD, env={}).tasks["digits"].role_models == {"default": "policy"}
    found = {path: (line, rendered) for line, path, rendered in issues_of(
        TEAM.replace("      code: coder\n", "      code: codr\n      'a b': coder\n")
    )}
    assert found["tasks.team.roles"][1].endswith(
        "role name 'a b' must be 1-64 letters, digits, '_', '.' or '-', starting with a letter "
        "or digit (the agent sends it as the model name)")
    # each role's model is checked where the role names it
    assert found["tasks.team.roles.code"] == (
        13,
        ("r.yaml:13: tasks.team.roles.code = 'codr': is not a key of models: use one of "
        "coder, planner; did you mean 'coder'?"),
    )
    found = {path: rendered for _, path, rendered in issues_of(
        TEAM + "    model: planner\n    inference: local\n")}
    assert found["tasks.team.model"] == (
        "r.yaml:14: tasks.team.model = 'planner': a team task names its models under roles: "
        "(here plan: planner, code: coder): remove model:")
    assert "local inference serves one model on the node" in found["tasks.team.inference"]
    # the sampling of a team's task must fit each of its models
    [(_, path, rendered)] = issues_of(TEAM + "    sampling: {max_tokens: 200}\n")
    assert path == "tasks.team.sampling.max_tokens"
    assert "exceeds models.coder.generation.max_new_tokens (128)" in rendered
    [(line, path, rendered)] = issues_of(GOOD.replace("    model: policy\n", ""))
    assert (line, path) == (7, "tasks.digits.model") and rendered == (
        "r.yaml:7: tasks.digits.model: required key is missing: name the key under models: "
        "that trains on this task, or give roles: (role: model key) for a team of models")


def test_cross_field_checks_run_alongside_field_errors() -> None:
    text = """\
models:
  policy:
    model: builtin:tiny
    generation:
      max_new_tokens: 16
tasks:
  a:
    env: envs.a:make_env
    agent: agents.a:agent
    model: ghost
    group_size: 0
  b:
    env: envs.b:make_env
    agent: agents.b:agent
    model: policy
    group_size: 8
    concurrency: 4
    sampling:
      max_tokens: 32
"""
    found = {path: rendered for _, path, rendered in issues_of(text)}
    assert set(found) == {
        "tasks.a.model",
        "tasks.a.group_size",
        "tasks.b.concurrency",
    }
    assert (
        "r.yaml:17: tasks.b.concurrency = 4: is less than group_size (8)"
        in found["tasks.b.concurrency"]
    )
    # once b's fields are valid, its max_tokens is checked against the server's cap
    fixed = text.replace("    concurrency: 4\n", "")
    found = {path: rendered for _, path, rendered in issues_of(fixed)}
    assert found["tasks.b.sampling.max_tokens"] == (
        "r.yaml:18: tasks.b.sampling.max_tokens = 32: exceeds "
        "models.policy.generation.max_new_tokens (16), the server's cap on any request: "
        "lower max_tokens to 16 or raise max_new_tokens"
    )


def test_max_tokens_must_leave_room_for_the_prompt() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    generation: {max_context_tokens: 64}\n",
    )
    [(line, path, rendered)] = issues_of(text + "    sampling: {max_tokens: 64}\n")
    assert (line, path) == (12, "tasks.digits.sampling.max_tokens")
    assert "leaves no room for the prompt" in rendered


def test_entry_points_are_checked_for_syntax_without_importing() -> None:
    ok = parse_recipe(GOOD.replace("envs.digits:make_env", "no.such.module:make"), env={})
    assert ok.tasks["digits"].env == "no.such.module:make"
    [(line, _, rendered)] = issues_of(GOOD.replace("envs.digits:make_env", "envs.digits"))
    assert line == 8 and "must be 'module:function'" in rendered


def test_duplicate_keys_are_reported() -> None:
    text = GOOD.replace("  name: t\n", "  name: t\n  name: u\n")
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (3, "run.name") and "first on line 2" in rendered


def test_env_var_set_default_and_escape() -> None:
    text = GOOD + (
        "    clients: ${CLIENTS:-3}\n"
        "    env_args:\n"
        "      key: '${KEY}'\n"
        "      raw: $${HOME} is ${KEY}\n"
    )
    recipe = parse_recipe(text, env={"KEY": "s3cret"})
    assert recipe.tasks["digits"].clients == 3
    assert recipe.tasks["digits"].env_args == {"key": "s3cret", "raw": "${HOME} is s3cret"}
    recipe = parse_recipe(text, env={"KEY": "k", "CLIENTS": "5"})
    assert recipe.tasks["digits"].clients == 5
    # like the shell, an empty value takes the default
    assert parse_recipe(text, env={"KEY": "k", "CLIENTS": ""}).tasks["digits"].clients == 3


def test_env_var_unset_names_line_and_variable() -> None:
    text = GOOD.replace("  name: t\n", "  name: t\n  token: ${JET_TOKEN}\n")
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (3, "run.token")
    assert "environment variable JET_TOKEN is not set" in rendered


def test_env_var_bad_value_names_its_source_and_hides_secrets() -> None:
    text = GOOD + "    clients: ${CLIENTS}\n"
    [(line, _, rendered)] = issues_of(text, env={"CLIENTS": "many"})
    assert line == 11 and rendered.endswith("must be an integer (value from ${CLIENTS})")
    secret = GOOD.replace("  name: t\n", "  name: t\n  token: ${TOKEN}\n")
    with pytest.raises(RecipeError) as caught:
        parse_recipe(secret.replace("run:\n", "run:\n  bogus: 1\n"), env={"TOKEN": "s3cret"})
    assert "s3cret" not in caught.value.render()


def test_syntax_error_is_one_issue_with_its_line() -> None:
    [(line, _, rendered)] = issues_of("models:\n  p:\n    model: x\n   bad: [\n")
    assert line == 4 and rendered.startswith("r.yaml:4: YAML syntax error")


def test_missing_file_is_one_issue(tmp_path: Path) -> None:
    with pytest.raises(RecipeError) as caught:
        load_recipe(tmp_path / "nope.yaml")
    assert caught.value.render() == f"{tmp_path / 'nope.yaml'}: file not found"


def test_recipe_built_in_python_runs_the_same_checks() -> None:
    with pytest.raises(ValueError, match="tasks.digits.model = 'x': is not a key of models"):
        Recipe.model_validate(
            {
                "models": {"p": {"model": "m"}},
                "tasks": {"digits": {"env": "a:b", "agent": "a:b", "model": "x"}},
            }
        )


def test_docs_reference_is_generated_from_the_schema() -> None:
    doc = (ROOT / "docs" / "recipe.md").read_text(encoding="utf-8")
    generated = doc.split(BEGIN_MARK, 1)[1].split(END_MARK, 1)[0]
    assert generated.strip() == reference_markdown().strip(), (
        "docs/recipe.md is stale: run python -m jetctl.recipe --write-docs docs/recipe.md"
    )


# ---------------------------------------------------------------- jetctl validate


def test_cli_validate_ok_and_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(GOOD + "    group_size: 1\n    grup_size: 2\n", encoding="utf-8")
    good = ROOT / "recipes" / "tiny.yaml"
    result = CliRunner().invoke(build_app(), ["validate", str(good), str(bad)])
    assert result.exit_code == 1, result.output
    assert f"ok: {good} (1 model, 1 task)" in result.stdout
    assert f"{bad}:11: tasks.digits.group_size = 1: must be >= 2" in result.stderr
    assert f"{bad}:12: tasks.digits.grup_size = 2: unknown key; did you mean" in result.stderr
    assert "Traceback" not in result.output


def test_cli_validate_all_ok_exits_zero() -> None:
    result = CliRunner().invoke(build_app(), ["validate", *map(str, RECIPES)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("ok: ") == len(RECIPES)


def test_cli_validate_missing_file_and_syntax_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  p: [\n", encoding="utf-8")
    missing = tmp_path / "missing.yaml"
    result = CliRunner().invoke(build_app(), ["validate", str(missing), str(broken)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"{missing}: file not found"
    assert lines[1].startswith(f"{broken}:3: YAML syntax error")
    assert len(lines) == 2 and "Traceback" not in result.output


def test_docker_socket_needs_the_docker_runtime() -> None:
    text = GOOD + "    docker_socket: true\n"
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (11, "tasks.digits.docker_socket")
    assert "only applies to runtime: docker" in rendered and "set runtime: docker" in rendered
    ok = parse_recipe(text + "    runtime: docker\n", file="r.yaml", env={})
    assert ok.tasks["digits"].docker_socket


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vllm is installed: the engine is allowed"
)
def test_engine_vllm_is_refused_where_vllm_is_not_importable() -> None:
    text = GOOD.replace("    model: builtin:tiny\n", "    model: builtin:tiny\n    engine: vllm\n")
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (6, "models.policy.engine")
    assert "'vllm'" in rendered and "pip install vllm" in rendered and "engine: hf" in rendered


def test_kl_penalty_needs_lora() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    finetune: full\n    train:\n      kl_coef: 0.05\n",
    )
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (8, "models.policy.train.kl_coef")
    assert "needs finetune: lora" in rendered and "0.05" in rendered


def test_lora_settings_under_full_fine_tuning_are_refused() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    finetune: full\n    lora: {r: 8}\n",
    )
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (7, "models.policy.lora")
    assert "only applies to finetune: lora" in rendered


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("s3://bucket/run", "needs a package that is not installed"),
        ("nosuchfs://x/y", "unknown filesystem 'nosuchfs'"),
        ("memory://ck", "lives only inside the server process"),
    ],
)
def test_checkpoint_urls_that_cannot_be_written_are_refused(url: str, why: str) -> None:
    if url.startswith("s3:") and importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here, so s3:// checkpoints are supported")
    text = GOOD.replace(
        "    model: builtin:tiny\n", f"    model: builtin:tiny\n    checkpoint:\n      dir: {url}\n"
    )
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (7, "models.policy.checkpoint.dir")
    assert why in rendered and url in rendered


@pytest.mark.parametrize("folder", ["file:///tmp/jetctl-ck", "/tmp/jetctl-ck", "ck"])
def test_checkpoint_folders_and_file_urls_validate(folder: str) -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n", f"    model: builtin:tiny\n    checkpoint:\n      dir: {folder}\n"
    )
    assert parse_recipe(text, env={}).models["policy"].checkpoint.dir == folder


def test_a_generation_dtype_for_engine_vllm_is_refused() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    engine: vllm\n    generation: {dtype: bfloat16}\n",
    )
    found = {path: (line, rendered) for line, path, rendered in issues_of(text)}
    line, rendered = found["models.policy.generation.dtype"]
    assert line == 7
    assert "'bfloat16'" in rendered and "engine vllm loads the model in the model's dtype" in rendered
    assert "set dtype" in rendered
    # the model's own dtype is no second dtype, and auto picks the model's for vllm:
    # nothing to refuse on that line
    for fine in ("{dtype: float32}", "{dtype: auto}"):
        same = text.replace("{dtype: bfloat16}", fine)
        try:
            parse_recipe(same, file="r.yaml", env={})
        except RecipeError as e:  # where vllm is not importable, the engine line is refused
            assert "models.policy.generation.dtype" not in {i.path for i in e.issues}


def test_settings_the_task_runtime_would_ignore_are_refused() -> None:
    """Container limits and an image under runtime: process are not applied there: refused,
    each on its own line, where they would otherwise be accepted and ignored."""
    text = GOOD.replace(
        "    model: policy\n",
        "    model: policy\n    image: my-agent:1\n    resources: {cpus: 1, memory: 2g}\n",
    )
    found = {path: (line, rendered) for line, path, rendered in issues_of(text)}
    assert set(found) == {"tasks.digits.image", "tasks.digits.resources.cpus",
                          "tasks.digits.resources.memory"}
    assert found["tasks.digits.image"][0] == 11
    assert "only applies to runtime: docker" in found["tasks.digits.image"][1]
    assert "my-agent:1" in found["tasks.digits.image"][1]
    assert "not applied by runtime: process" in found["tasks.digits.resources.memory"][1]
    docker = text.replace("    image: my-agent:1\n", "    image: my-agent:1\n    runtime: docker\n")
    assert parse_recipe(docker, env={}).tasks["digits"].resources.memory == "2g"


def test_two_models_in_one_checkpoint_folder_are_refused() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    checkpoint: {dir: /tmp/ck}\n"
        "  critic:\n    model: builtin:tiny\n    checkpoint: {dir: /tmp/ck/}\n",
    )
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (9, "models.critic.checkpoint.dir")
    assert "is also models.policy.checkpoint.dir" in rendered
    apart = text.replace("{dir: /tmp/ck/}", "{dir: /tmp/ck2}")
    assert set(parse_recipe(apart, env={}).models) == {"policy", "critic"}


def test_generation_threads_for_engine_vllm_is_refused() -> None:
    text = GOOD.replace(
        "    model: builtin:tiny\n",
        "    model: builtin:tiny\n    engine: vllm\n    generation: {threads: 4}\n",
    )
    found = {path: (line, rendered) for line, path, rendered in issues_of(text)}
    line, rendered = found["models.policy.generation.threads"]
    assert line == 7 and "does not read it" in rendered


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm installed here")
def test_what_a_server_elsewhere_needs_is_checked_where_it_runs() -> None:
    """engine: vllm and an s3:// checkpoint folder need packages on the server's host. A
    server the controller starts here is checked here (above); one that runs elsewhere
    (runtime: external or ray) is not refused for this host's packages, and the server
    itself refuses to start, naming the key, where they are missing."""
    from jetctl.server.app import check_devices

    body = "    model: builtin:tiny\n    engine: vllm\n    runtime: external\n"
    if importlib.util.find_spec("s3fs") is None:
        body += "    checkpoint: {dir: 's3://bucket/run'}\n"
    recipe = parse_recipe(GOOD.replace("    model: builtin:tiny\n", body), env={})
    cfg = recipe.models["policy"]
    with pytest.raises(SystemExit) as stopped:
        check_devices("policy", cfg)
    message = str(stopped.value)
    assert message.startswith("models.policy.engine: 'vllm' needs the vllm package")
    assert "checked on this host, where the server runs" in message
    if "s3://" in body:
        cfg = cfg.model_copy(update={"engine": "hf"})
        with pytest.raises(SystemExit, match=r"models.policy.checkpoint.dir: 's3://bucket/run'"):
            check_devices("policy", cfg)


def test_local_inference_in_a_shipped_image_without_torch_is_refused() -> None:
    text = GOOD.replace(
        "    model: policy\n",
        "    model: policy\n    runtime: docker\n    inference: local\n",
    )
    [(line, path, rendered)] = issues_of(text)
    assert (line, path) == (12, "tasks.digits.inference")
    assert "jetctl-base" in rendered and "has none" in rendered
    web = text.replace("    runtime: docker\n", "    runtime: docker\n    image: jetctl-web:latest\n")
    [(_, _, rendered)] = issues_of(web)
    assert "jetctl-web:latest" in rendered
    own = text.replace("    runtime: docker\n", "    runtime: docker\n    image: my-torch-node\n")
    assert parse_recipe(own, env={}).tasks["digits"].inference == "local"
