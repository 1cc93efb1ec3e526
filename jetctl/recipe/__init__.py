"""Recipe: one pydantic model tree for the run, its models and its tasks.

Load with `load_recipe(path)`; errors come all at once as a `RecipeError` whose issues
carry the YAML line, the dotted key, the value and the fix (`jetctl validate FILE`).
`${VAR}` and `${VAR:-default}` are interpolated from the environment into scalar values
before validation (`$${` writes a literal `${`).

    schema.py     the models: Recipe, RunConfig, ModelConfig, TrainConfig, TaskConfig, ...
    checks.py     the cross-field checks their validators run, each problem a `Problem`
                  that `CrossFieldError` carries to the loader with its key
    loading.py    load_recipe / parse_recipe: YAML with line numbers, `${VAR}`, and
                  RecipeError, whose messages name the line, the value and the fix
    reference.py  the field reference of docs/recipe.md, generated from the schema:
                  `python -m jetctl.recipe --write-docs docs/recipe.md`

Imports run one way: schema imports checks (checks names the models in annotations only),
reference imports schema, loading imports all three.

Left out: checking that `env`/`agent` modules import (only their `module:function` syntax
is checked; importing user code belongs to the client) and that model sources exist.
"""

from jetctl.recipe.checks import server_host_problems
from jetctl.recipe.loading import RecipeError, RecipeIssue, load_recipe, parse_recipe
from jetctl.recipe.reference import BEGIN_MARK, END_MARK, reference_fields, reference_markdown
from jetctl.recipe.schema import (
    DEFAULT_ROLE,
    CheckpointConfig,
    EvalConfig,
    GenerationConfig,
    LimitsConfig,
    LoraConfig,
    ModelConfig,
    OptimizerConfig,
    RayConfig,
    Recipe,
    TaskConfig,
    TlsConfig,
    TrackerConfig,
    TrainConfig,
    byte_size,
)

__all__ = [
    "BEGIN_MARK",
    "DEFAULT_ROLE",
    "END_MARK",
    "CheckpointConfig",
    "EvalConfig",
    "GenerationConfig",
    "LimitsConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RayConfig",
    "Recipe",
    "RecipeError",
    "RecipeIssue",
    "TaskConfig",
    "TlsConfig",
    "TrackerConfig",
    "TrainConfig",
    "byte_size",
    "load_recipe",
    "parse_recipe",
    "reference_fields",
    "reference_markdown",
    "server_host_problems",
]
