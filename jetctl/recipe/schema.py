"""The recipe's schema: one pydantic model tree, `Recipe` (run:, models:, tasks:) down to
`RunConfig`, `ModelConfig` (with its `TrainConfig`, `CheckpointConfig`,
`GenerationConfig`, ...) and `TaskConfig`: each field's type, bounds, default and
description (docs/recipe.md's field reference is generated from them: reference.py).

A field's own constraint is a pydantic bound or a `field_validator`; a check of one field
against another is a `model_validator` on the smallest model that holds both, which
reports through checks.py (`Problem`, `CrossFieldError`) so that each problem keeps its key.
Loading a file (YAML, `${VAR}`, the errors' lines) is loading.py's.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jetctl.recipe.checks import (
    MISSING,
    Problem,
    _algorithm_problems,
    _deterministic_problems,
    _model_refs,
    _raise_problems,
    _recipe_problems,
    checkpoint_url_problem,
    server_host_problems,
)

# The algorithms train.algorithm accepts, each the name of its module in
# jetctl/server/algorithms/ (that registry reads its names from here: the recipe is the
# vocabulary, the server the code; a new algorithm adds its file there and its name here).
AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraConfig(_Strict):
    r: int = Field(default=16, ge=1, description="LoRA rank")
    alpha: int = Field(
        default=32, ge=1, description="LoRA scale; the update is scaled by alpha / r"
    )
    dropout: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the LoRA input, in the trainer's forward only (generation "
        "never sees it)",
    )
    target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the modules to adapt",
    )


class OptimizerConfig(_Strict):
    lr: float = Field(default=1e-5, gt=0, description="learning rate")
    weight_decay: float = Field(default=0.0, ge=0, description="decoupled weight decay")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="Adam (beta1, beta2)")
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="clip gradients to this global L2 norm"
    )


class TrainConfig(_Strict):
    algorithm: AlgorithmName = Field(
        default="grpo",
        description="policy-gradient algorithm, one file each in jetctl/server/algorithms/: "
        "grpo (group-normalised advantages, PPO-clip, token mean), dr_grpo (no std "
        "normalisation, constant normaliser), dapo (clip-higher: clip_eps_high), gspo "
        "(sequence-level ratio and clip), rloo (leave-one-out baseline)",
    )
    groups_per_step: int = Field(default=2, ge=1, description="groups in one optimizer step")
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="refuse groups whose lag (server version - oldest call version) "
        "exceeds this many steps",
    )
    order: Literal["oldest", "newest"] = Field(
        default="oldest",
        description="which buffered groups a step takes first: oldest (arrival order) or "
        "newest (made at the highest model version first: the freshest data when generation "
        "outruns training; older groups wait, and are refused once past max_staleness)",
    )
    clip_eps: float = Field(
        default=0.2, gt=0, description="epsilon of PPO-clip: ratio clipped to [1 - eps, 1 + eps]"
    )
    clip_eps_high: float | None = Field(
        default=None, gt=0,
        description="algorithm dapo: the upper clip range eps_high, ratio clipped to "
        "[1 - clip_eps, 1 + clip_eps_high] (null: DAPO's 0.28)",
    )
    tis_cap: float | None = Field(
        default=None, ge=1,
        description="truncated importance sampling, with any algorithm: weight each token by "
        "min(exp(logp_trainer - logp_engine), tis_cap), correcting the gap between the "
        "engine's and the trainer's logprobs (null: off; e.g. 2.0)",
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="beta: weight of the KL penalty against the reference policy, the base "
        "model (finetune: lora only; 0: none)",
    )
    merge: Literal["off", "linear", "tree"] = Field(
        default="tree",
        description="off: one sequence per call; linear: merge calls whose context extends "
        "an earlier call; tree: also pack shared prefixes as a prefix tree",
    )
    max_tokens_per_microbatch: int = Field(
        default=8192, ge=64, description="token budget of one forward/backward micro-batch"
    )
    threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the trainer's torch work (null: the cores generation.threads "
        "leaves, at least one)",
    )
    lend_threads: bool = Field(
        default=False,
        description="while the trainer computes no step (it waits for groups), engine hf on "
        "a CPU server uses train.threads too, checked before each forward (generate/lent_s in "
        "the step row); engine hf on a CPU only",
    )
    max_steps: int | None = Field(
        default=None, ge=1,
        description="stop training after this many steps (null: no limit); the server "
        "checkpoints and exits, the client nodes of the tasks that train this model drain, "
        "and the run ends when every model is done",
    )
    mix: dict[str, float] = Field(
        default={},
        description="task -> share of each batch's groups, e.g. {web: 0.5, code: 0.3, api: 0.2}"
        " (shares sum to 1; every task training this model named). {}: batches take groups "
        "in the order they arrive, whatever their task",
    )
    mix_wait_s: float = Field(
        default=10.0,
        gt=0,
        description="with mix: how long a batch waits for a task short of its share before "
        "other tasks' groups fill its slots (counted; the task shown starving)",
    )

    @field_validator("mix")
    @classmethod
    def _shares(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {t: v for t, v in value.items() if not v > 0}
        if bad:
            raise ValueError(f"every share must be > 0, got {bad}: remove the task or give it "
                             "a share")
        total = sum(value.values())
        if value and abs(total - 1.0) > 1e-6:
            raise ValueError(f"shares sum to {total:g}, not 1: scale them, e.g. "
                             + ", ".join(f"{t}: {v / total:.3g}" for t, v in value.items()))
        return value


class CheckpointConfig(_Strict):
    every_steps: int = Field(default=10, ge=1, description="checkpoint every this many steps")
    keep: int = Field(default=3, ge=1, description="how many recent checkpoints to keep")
    dir: str | None = Field(
        default=None,
        description="folder or fsspec URL, e.g. s3://bucket/run (needs s3fs) or file:///path "
        "(null: <run dir>/checkpoints/<model>)",
    )
    keep_trained_groups: Literal["all"] | int | None = Field(
        default=None,
        description="trained groups whose tokens the store keeps, so that `jetctl replay` and "
        "`jetctl up --replay-from` can take their steps again: all (every step of the run "
        "replays; the store grows with every group), or N in 1..keep: those of the steps "
        "after the Nth newest checkpoint (1: only since the newest, which a restarted server "
        "trains again anyway) (null: keep, so every step after the oldest checkpoint kept "
        "replays, and the store holds about keep x every_steps steps of groups)",
    )

    @field_validator("dir")
    @classmethod
    def _known_filesystem(cls, value: str | None) -> str | None:
        if value is not None:
            problem = checkpoint_url_problem(value, packages=False)  # server_host_problems
            if problem:
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _groups_kept_within_checkpoints(self) -> CheckpointConfig:
        n = self.keep_trained_groups
        if isinstance(n, int) and n < 1:
            _raise_problems([Problem(
                ("keep_trained_groups",), n,
                "must be at least 1 (the groups trained since the newest checkpoint are what a "
                "restarted server trains again): use 1 for the least disk, or all",
            )])
        if isinstance(n, int) and n > self.keep:
            _raise_problems([Problem(
                ("keep_trained_groups",), n,
                f"is more than keep ({self.keep}): the groups of steps before the oldest "
                "checkpoint kept have no checkpoint to replay from, so they would fill the "
                f"disk for nothing: set keep to {n}, lower this to {self.keep}, or use all",
            )])
        return self

    @property
    def trained_groups_checkpoints(self) -> int | None:
        """The checkpoints whose later steps' groups keep their tokens (None: all groups)."""
        n = self.keep_trained_groups
        if isinstance(n, int):
            return n
        return self.keep if n is None else None  # None: all


class GenerationConfig(_Strict):
    max_batch_size: int = Field(
        default=16, ge=1, description="most replies generated together (rows of a decode step)"
    )
    batch_wait_ms: float = Field(
        default=20.0, ge=0,
        description="how long an idle engine waits for company before it starts (later "
        "requests join the running batch at its next step)"
    )
    max_new_tokens: int = Field(default=256, ge=1, description="cap on any request's max_tokens")
    threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the engine's torch work (null: half of this host's cores "
        "on a CPU server, the rest go to train.threads; generation and training run at once)",
    )
    workers: int = Field(
        default=1, ge=1, le=64,
        description="engine hf only: how many batches it decodes at once, each on its own "
        "worker thread and its own copy of the adapter (or of the weights in "
        "generation.dtype; finetune: full, of the whole model), with generation.threads "
        "shared out among them (at least one each). A group's requests and a "
        "conversation's turns stay on one worker. On a CPU, two batches of SmolLM2-135M "
        "on one thread each decode 1.6-1.8x the tokens a second of one batch on two "
        "threads (1.04-1.2x) when nothing else runs; in the quickstart on 2 cores, where "
        "the trainer and the client nodes share them, 2 workers made no more trajectories "
        "and reached a reward of 0.8 later (README, Performance), so the default is 1",
    )
    max_context_tokens: int = Field(
        default=2048, ge=16, description="cap on prompt + completion tokens of one request"
    )
    device: str | None = Field(
        default=None,
        description="device of the engine's own copy of the weights, e.g. cuda:1, refreshed "
        "after each optimizer step (null: engine hf generates on the trainer's device, on the "
        "trainer's model object with finetune: full, on its own copy of the adapter over the "
        "shared base with lora; "
        "engine continuous keeps its copy on the trainer's device)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="dtype of the weights the engine generates with (null: the model's dtype). "
        "Another dtype than the model's gives the engine its own copy in that dtype, refreshed "
        "after each optimizer step (LoRA: the adapter only); replies carry that copy's "
        "logprobs and the trainer's importance ratio corrects for the difference. bfloat16 "
        "halves the weight bytes a decode step reads, but is faster only where the hardware "
        "computes in it (SmolLM2-135M, a decode step at 14 rows: 74 ms against 104 ms in "
        "float32 on a CPU with avx512_bf16; 527 ms against 192 ms on an AVX2-only CPU). auto: "
        "bfloat16 where this host measures it faster (the server times its largest matrix in "
        "both at start and logs the figures; a CUDA device with bfloat16), else the model's "
        "dtype; never for engine vllm or a model that is not float32",
    )
    publish_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="deadline of one weight publish to an engine with its own copy (waiting "
        "for the requests under way included); a miss is logged and retried, and 3 steps in "
        "a row without a publish stop the server",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str | None) -> str | None:
        if value is not None and not _DEVICE.match(value):
            raise ValueError("must be cpu, cuda, cuda:N or mps (or null)")
        return value


class LimitsConfig(_Strict):
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="largest gRPC message accepted; larger ones get RESOURCE_EXHAUSTED",
    )
    max_buffer_groups: int = Field(
        default=1024,
        ge=1,
        description="accepted groups a server holds untrained; past it Submit acks BUSY and "
        "the client keeps the group spooled and sends it again later",
    )
    max_buffer_bytes: int = Field(
        default=1 << 30,
        ge=1024,
        description="payload bytes of the accepted groups a server holds untrained (a bound "
        "on its memory whatever the groups' size); past it Submit acks BUSY as for "
        "max_buffer_groups. At least max_message_bytes, so that any one group fits",
    )
    max_queued_generates: int = Field(
        default=1024,
        ge=1,
        description="Generate calls waiting for a row of the engine (beyond "
        "generation.max_batch_size; every call held, for an engine that does not say how "
        "many rows it has); past it Generate answers RESOURCE_EXHAUSTED with a retry-after "
        "and the node calls again after that wait, its rollout going on",
    )
    max_concurrent_rpcs: int = Field(
        default=4096,
        ge=2,
        description="RPCs the server runs at once, of every kind (gRPC's "
        "maximum_concurrent_rpcs); past it a call gets RESOURCE_EXHAUSTED at once. A "
        "backstop above max_queued_generates, so that Generate's bound (with its "
        "retry-after) answers first",
    )

    @model_validator(mode="after")
    def _one_group_fits(self) -> LimitsConfig:
        if self.max_buffer_bytes < self.max_message_bytes:
            raise ValueError(
                f"max_buffer_bytes ({self.max_buffer_bytes}) is below max_message_bytes "
                f"({self.max_message_bytes}): a group that large could never be buffered; set "
                f"max_buffer_bytes to at least {self.max_message_bytes}"
            )
        return self

    @model_validator(mode="after")
    def _queue_bound_answers_first(self) -> LimitsConfig:
        if self.max_concurrent_rpcs <= self.max_queued_generates:
            raise ValueError(
                f"max_concurrent_rpcs ({self.max_concurrent_rpcs}) is not above "
                f"max_queued_generates ({self.max_queued_generates}): Generate calls would be "
                "refused without a retry-after before the engine's queue is full; set "
                f"max_concurrent_rpcs above it, e.g. to {2 * self.max_queued_generates}"
            )
        return self


_ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_BYTE_SIZE = re.compile(r"^[0-9]+(\.[0-9]+)?[bkmg]?$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """`512m`, `2g`, `1024` (bytes) as bytes (a value `_BYTE_SIZE` accepted)."""
    unit = text[-1].lower()
    scale = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(unit)
    return int(float(text[:-1]) * scale) if scale else int(float(text))


class ServerResources(_Strict):
    """What a server asks of its Ray node (runtime: ray); the process runtime reserves none."""

    cpus: float | None = Field(default=None, gt=0, description="CPUs reserved (null: 1)")
    gpus: float | None = Field(default=None, ge=0, description="GPUs reserved (null: none)")
    memory: str | None = Field(
        default=None, description="memory reserved, a number with b, k, m or g (e.g. 8g)"
    )
    custom: dict[str, float] = Field(
        default={},
        description="Ray custom resources the placement needs, e.g. {gpu_host: 1} (runtime: ray)",
    )

    @field_validator("memory")
    @classmethod
    def _byte_size(cls, value: str | None) -> str | None:
        if value is not None and not _BYTE_SIZE.match(value):
            raise ValueError("must be a number with an optional unit b, k, m or g, e.g. 512m or 2g")
        return value


class ModelConfig(_Strict):
    model: str = Field(
        description="builtin:tiny | builtin:smollm2-135m-instruct | HF repo id | local folder"
    )
    device: str = Field(default="cpu", description="torch device of the server: cpu, cuda, cuda:1")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="weight dtype"
    )
    engine: Literal["hf", "continuous", "vllm"] = Field(
        default="hf",
        description="inference engine: hf (continuous batching on the trainer's weights: "
        "newcomers join between decode steps), continuous (transformers' continuous batching "
        "with a paged KV cache; for CUDA) or vllm "
        "(experimental; needs vllm installed, CUDA)",
    )
    finetune: Literal["lora", "full"] = Field(
        default="lora", description="train a LoRA adapter (peft) or every weight"
    )
    lora: LoraConfig = Field(default=LoraConfig(), description="used when finetune is lora")
    optimizer: OptimizerConfig = Field(default=OptimizerConfig(), description="optimizer")
    train: TrainConfig = Field(default=TrainConfig(), description="training loop")
    checkpoint: CheckpointConfig = Field(default=CheckpointConfig(), description="checkpoints")
    generation: GenerationConfig = Field(default=GenerationConfig(), description="serving")
    limits: LimitsConfig = Field(default=LimitsConfig(), description="wire limits")
    host: str = Field(default="127.0.0.1", description="address the server binds")
    advertise: str | None = Field(
        default=None,
        description="address clients dial (null: host; for a wildcard host such as 0.0.0.0, "
        "the server's address on its route to the controller)",
    )
    runtime: Literal["process", "ray", "external"] = Field(
        default="process",
        description="process: a subprocess of the controller; ray: an actor on run.ray's "
        "cluster; external: you start it on any host with `jetctl server --join`",
    )
    resources: ServerResources = Field(
        default=ServerResources(), description="what the server reserves (runtime: ray)"
    )
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port (0: pick a free port)")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus /metrics port (0: pick a free port)"
    )
    seed: int = Field(default=0, description="seed of the server's RNG")

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        problems: list[Problem] = []
        if self.runtime == "process":  # else the server checks on its own host as it starts
            problems += server_host_problems(self)
        if self.engine == "vllm" and self.generation.dtype not in (None, "auto", self.dtype):
            problems.append(
                Problem(
                    ("generation", "dtype"),
                    self.generation.dtype,
                    f"engine vllm loads the model in the model's dtype ({self.dtype}) and takes "
                    "the trainer's tensors as they are: remove generation.dtype, or set dtype "
                    "(the model's) instead",
                )
            )
        if self.engine == "vllm" and self.generation.threads is not None:
            problems.append(
                Problem(
                    ("generation", "threads"),
                    self.generation.threads,
                    "sets the CPU threads of the hf and continuous engines; engine vllm "
                    "generates on its GPU and does not read it: remove it",
                )
            )
        gen_device = self.generation.device or self.device
        if self.train.lend_threads and (self.engine != "hf" or not gen_device.startswith("cpu")):
            problems.append(
                Problem(
                    ("train", "lend_threads"),
                    self.train.lend_threads,
                    f"lends the trainer's CPU threads to engine hf generating on a CPU; this "
                    f"model's engine is {self.engine} on {gen_device}: remove it",
                )
            )
        if self.generation.workers > 1 and self.engine != "hf":
            problems.append(
                Problem(
                    ("generation", "workers"),
                    self.generation.workers,
                    f"runs several engine hf workers side by side; engine {self.engine} "
                    "batches on its own: remove it or set 1",
                )
            )
        if self.generation.workers > 1 and self.train.lend_threads:
            problems.append(
                Problem(
                    ("train", "lend_threads"),
                    self.train.lend_threads,
                    f"lends the trainer's threads to one engine worker; with "
                    f"generation.workers {self.generation.workers} the workers already use "
                    "the cores: remove it, or set generation.workers to 1",
                )
            )
        if self.finetune == "full" and self.train.kl_coef > 0:
            problems.append(
                Problem(
                    ("train", "kl_coef"),
                    self.train.kl_coef,
                    "needs finetune: lora, where the reference policy is the base model with "
                    "the adapter switched off; full fine-tuning would need a second copy of "
                    "the model, which jetctl does not keep: set kl_coef to 0 or use lora",
                )
            )
        if self.finetune == "full" and "lora" in self.model_fields_set:
            problems.append(
                Problem(
                    ("lora",),
                    self.lora.model_dump(),
                    "only applies to finetune: lora (this model trains every weight): remove "
                    "lora: or set finetune: lora",
                )
            )
        if self.runtime != "ray" and "resources" in self.model_fields_set:
            problems.append(
                Problem(
                    ("resources",),
                    self.resources.model_dump(exclude_defaults=True),
                    f"only applies to runtime: ray (this server runs as {self.runtime}, which "
                    "reserves nothing): remove it or set runtime: ray",
                )
            )
        problems += _algorithm_problems(self.train)
        if "mix_wait_s" in self.train.model_fields_set and not self.train.mix:
            problems.append(
                Problem(
                    ("train", "mix_wait_s"),
                    self.train.mix_wait_s,
                    "only applies with train.mix (no mix: batches never wait for a task): "
                    "remove it or give mix:",
                )
            )
        if self.port and self.port == self.metrics_port:
            problems.append(
                Problem(
                    ("metrics_port",),
                    self.metrics_port,
                    f"is the same as port ({self.port}): use another port, or 0 to pick one",
                )
            )
        _raise_problems(problems)
        return self


class SamplingConfig(_Strict):
    """Defaults for the knobs an agent's request leaves out; a value the request sets wins."""

    temperature: float = Field(
        default=1.0, ge=0, description="temperature of a request that does not set one"
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="nucleus mass of a request that does not set one"
    )
    max_tokens: int = Field(
        default=128, ge=1, description="max_tokens of a request that does not set one"
    )


_DEVICE = re.compile(r"^(cpu|mps|cuda(:[0-9]+)?)$")
_ROLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_ROLE = "default"  # the role of every call of a task without roles:


class ResourcesConfig(_Strict):
    """Limits of one client node's container (runtime: docker) or what it reserves on its Ray
    node (runtime: ray: cpus, gpus, memory, custom); the process runtime has none."""

    cpus: float | None = Field(
        default=None, gt=0, description="CPUs the container may use (1.5: one and a half)"
    )
    memory: str | None = Field(
        default=None, description="memory cap, a number with b, k, m or g (e.g. 2g); null: none"
    )
    pids: int | None = Field(
        default=None, ge=16, description="most processes and threads in the container; null: none"
    )
    shm: str | None = Field(
        default=None, description="size of /dev/shm (Chromium wants 256m or more); null: docker's 64m"
    )
    gpus: float | None = Field(
        default=None, ge=0, description="GPUs a node reserves (runtime: ray; null: none)"
    )
    custom: dict[str, float] = Field(
        default={},
        description="Ray custom resources each node needs, e.g. {cpu_host: 1} to place the "
        "nodes on workers started with `ray start --resources '{\"cpu_host\": 8}'` (runtime: ray)",
    )

    @field_validator("memory", "shm")
    @classmethod
    def _byte_size(cls, value: str | None) -> str | None:
        if value is not None and not _BYTE_SIZE.match(value):
            raise ValueError("must be a number with an optional unit b, k, m or g, e.g. 512m or 2g")
        return value


# what `jetctl images build` makes (jetctl/controller/runtimes/images.py): client images
# without torch
SHIPPED_IMAGES = frozenset({"jetctl-base", "jetctl-web", "jetctl-code", "jetctl-api"})


class EvalConfig(_Strict):
    """An eval during the run (jetctl/server/evals.py): after a checkpoint at a multiple of
    `every_steps`, the task's server runs `jetctl eval` on the held-out rows in a process of
    its own and logs the figures with the next step."""

    every_steps: int = Field(
        ge=1,
        description="eval the checkpoint of every this many steps: a multiple of the model's "
        "checkpoint.every_steps (the eval loads a checkpoint)",
    )
    split: Literal["test", "train"] = Field(
        default="test",
        description="the rows scored: test (the held-out rows: env_args.test_fraction or "
        "test_path) or train",
    )
    samples: int = Field(default=1, ge=1, description="K: samples per row (pass@K)")
    max_rows: int | None = Field(
        default=None,
        ge=1,
        description="score only the split's first this many rows (the same ones every time; "
        "null: all): the cost of each eval",
    )
    timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="an eval running longer is killed and logged as failed; the next due "
        "checkpoint is evaluated",
    )


class TaskConfig(_Strict):
    env: str = Field(description="module:factory of the environment, e.g. envs.arithmetic:make_env")
    agent: str = Field(description="module:function of the agent, e.g. agents.arithmetic:agent")
    model: str | None = Field(
        default=None,
        description="the key under models: that trains on this task (a team task names its "
        "models under roles: instead)",
    )
    roles: dict[str, str] = Field(
        default={},
        description="a team: agent role -> key under models:. The agent picks a role with the "
        "`model` field of its OpenAI call; each role's calls train that role's model, with the "
        "role's reward ({}: no team, one model)",
    )
    env_args: dict[str, object] = Field(
        default={}, description="keyword arguments of the env factory"
    )
    clients: int = Field(default=1, ge=0, description="client nodes running this task")
    group_size: int = Field(
        default=8, ge=2, description="G in GRPO: rollouts of one task per group"
    )
    concurrency: Literal["auto"] | int = Field(
        default="auto",
        description="rollouts a node runs at once. auto: sized by the server's load (starts at "
        "8, at least group_size; a group more while the trainer waits for groups and every "
        "slot is busy, a group less while the engine queues requests or the trainer has a "
        "backlog of 4 steps; between group_size and 8 x group_size; `jetctl status` shows the "
        "figure and why). A number: that many, fixed",
    )
    rollout_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="a rollout running longer is killed and recorded as timeout",
    )
    runtime: Literal["process", "docker", "ray"] = Field(
        default="process",
        description="process: subprocesses here; docker: a container per node; ray: an actor "
        "per node on run.ray's cluster, placed in one placement group per revision",
    )
    image: str | None = Field(
        default=None,
        description="docker image of the nodes (runtime: docker; null: jetctl-base, made by "
        "`jetctl images build`); `jetctl swap-clients --image` replaces it for a new revision",
    )
    resources: ResourcesConfig = Field(
        default=ResourcesConfig(),
        description="container limits (runtime: docker) or reservations (runtime: ray)",
    )
    docker_socket: bool = Field(
        default=False,
        description="mount the host's docker socket into the nodes' containers (runtime: "
        "docker), so the env can start sibling containers, e.g. the code env's "
        "`backend: docker` sandbox; it gives the node control of the host's docker engine",
    )
    network: Literal["isolated", "host"] = Field(
        default="isolated",
        description="the nodes' network (runtime: docker). isolated: a docker network of the "
        "run's own, no route out, from which only the controller and this host's servers "
        "are reached (they also listen on its gateway address); host: the host's network, "
        "every address this host reaches (logged as a warning)",
    )
    inference: Literal["server", "local"] = Field(
        default="server",
        description="server: generate on the model's server; local: on the client with "
        "weights pulled from the server",
    )
    sampling: SamplingConfig = Field(
        default=SamplingConfig(),
        description="sampling defaults of the agent's requests (the agent's own values win)",
    )
    spool_max_bytes: int = Field(
        default=512 * 1024 * 1024,
        ge=1024,
        description="back-pressure watermark: a node stops taking tasks above this spool size",
    )
    seed: int = Field(default=0, description="seed of task sampling")
    eval: EvalConfig | None = Field(
        default=None,
        description="an eval every N steps during the run (a dataset task): e.g. "
        "{every_steps: 10, max_rows: 40} (null: none; `jetctl eval` after the run)",
    )

    @property
    def role_models(self) -> dict[str, str]:
        """Role -> model key. A task without `roles:` has one role, `default`, on `model`."""
        if self.roles:
            return dict(self.roles)
        assert self.model is not None  # the validator requires model or roles
        return {DEFAULT_ROLE: self.model}

    @property
    def models(self) -> list[str]:
        """The distinct model keys this task trains, in recipe order."""
        return list(dict.fromkeys(self.role_models.values()))

    @field_validator("roles")
    @classmethod
    def _role_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [role for role in value if not _ROLE_NAME.match(role)]
        if bad:
            raise ValueError(
                f"role name {bad[0]!r} must be 1-64 letters, digits, '_', '.' or '-', starting "
                "with a letter or digit (the agent sends it as the model name)"
            )
        return value

    @field_validator("env", "agent")
    @classmethod
    def _entry_point(cls, value: str) -> str:
        if not _ENTRY_POINT.match(value):
            raise ValueError(
                "must be 'module:function' (a dotted module, a colon, a name), "
                "e.g. envs.arithmetic:make_env"
            )
        return value

    @field_validator("concurrency", mode="before")
    @classmethod
    def _auto_or_count(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise ValueError(
            "must be auto (sized by the server's load) or a whole number of rollouts, e.g. 16")

    @model_validator(mode="after")
    def _group_fits(self) -> TaskConfig:
        problems = []
        if self.model is None and not self.roles:
            problems.append(
                Problem(
                    ("model",),
                    MISSING,
                    "required key is missing: name the key under models: that trains on this task, or give "
                    "roles: (role: model key) for a team of models",
                )
            )
        if self.model is not None and self.roles:
            problems.append(
                Problem(
                    ("model",),
                    self.model,
                    "a team task names its models under roles: (here "
                    f"{', '.join(f'{r}: {m}' for r, m in self.roles.items())}): remove model:",
                )
            )
        if self.roles and self.inference == "local":
            problems.append(
                Problem(
                    ("inference",),
                    self.inference,
                    "local inference serves one model on the node; a team (roles:) generates "
                    "on its models' servers: use inference: server or remove roles:",
                )
            )
        if self.concurrency != "auto" and self.concurrency < self.group_size:
            problems.append(
                Problem(
                    ("concurrency",),
                    self.concurrency,
                    f"is less than group_size ({self.group_size}); a node runs a "
                    "group's rollouts at once so the server can batch them: set "
                    f"concurrency to at least {self.group_size}",
                )
            )
        ray_only = {"gpus", "custom"} & self.resources.model_fields_set
        docker_only = {"pids", "shm"} & self.resources.model_fields_set
        wrong = ray_only if self.runtime != "ray" else docker_only
        for key in sorted(wrong):
            problems.append(
                Problem(
                    ("resources", key),
                    getattr(self.resources, key),
                    f"only applies to runtime: {'ray' if key in ray_only else 'docker'} "
                    f"(this task runs as {self.runtime}): remove it or change runtime",
                )
            )
        if self.runtime == "process":  # the process runtime starts plain subprocesses
            for key in sorted({"cpus", "memory"} & self.resources.model_fields_set):
                problems.append(
                    Problem(
                        ("resources", key),
                        getattr(self.resources, key),
                        "is not applied by runtime: process (plain subprocesses, no limits): "
                        "use runtime: docker for container limits or runtime: ray for "
                        "reservations, or remove it",
                    )
                )
        shipped = self.image is None or self.image.split(":")[0] in SHIPPED_IMAGES
        if self.inference == "local" and self.runtime == "docker" and shipped:
            problems.append(
                Problem(
                    ("inference",), self.inference,
                    f"needs torch in the nodes' image, and {self.image or 'jetctl-base'} (like "
                    "every image `jetctl images build` makes) has none: use inference: server, "
                    "or an image of your own built FROM jetctl-base with torch installed",
                )
            )
        if self.image is not None and self.runtime != "docker":
            problems.append(
                Problem(
                    ("image",), self.image,
                    f"only applies to runtime: docker (this task runs as {self.runtime}): "
                    "remove it or set runtime: docker",
                )
            )
        if self.network != "isolated" and self.runtime != "docker":
            problems.append(
                Problem(
                    ("network",), self.network,
                    f"only applies to runtime: docker (this task runs as {self.runtime}): "
                    "remove it or set runtime: docker",
                )
            )
        if self.docker_socket and self.runtime != "docker":
            problems.append(
                Problem(
                    ("docker_socket",),
                    self.docker_socket,
                    f"only applies to runtime: docker (this task runs as {self.runtime}, "
                    "where the env reaches the engine directly): remove it or set "
                    "runtime: docker",
                )
            )
        if problems:
            _raise_problems(problems)
        return self


class TlsConfig(_Strict):
    mode: Literal["off", "tls", "mtls"] = Field(
        default="off",
        description="off: plaintext gRPC; tls: servers and the controller show a certificate "
        "of the run CA; mtls: callers must show one too",
    )
    cert_dir: str | None = Field(
        default=None,
        description="folder with ca.pem, server.pem, server.key, client.pem, client.key "
        "(null: jetctl up generates them in <run dir>/tls, keys 0600)",
    )
    hosts: list[str] = Field(
        default=[],
        description="extra DNS names or IPs clients dial, added to the generated server "
        "certificate (127.0.0.1, localhost, this host, models.<m>.host and .advertise, "
        "run.control.host and .advertise are always in)",
    )


class ControlConfig(_Strict):
    host: str = Field(
        default="127.0.0.1",
        description="address the controller's Control service binds (0.0.0.0: every "
        "interface, for nodes on other hosts)",
    )
    port: int = Field(
        default=0, ge=0, le=65535,
        description="its port (0: a free one, kept across `jetctl up --resume`)",
    )
    advertise: str | None = Field(
        default=None,
        description="address nodes on other hosts dial (null: host; for a wildcard host, the "
        "Ray node address of the controller with runtime: ray, else 127.0.0.1)",
    )


class RayConfig(_Strict):
    address: str | None = Field(
        default=None,
        description="the Ray cluster of runtime: ray nodes, as `ray.init(address=...)` takes "
        "it: host:port of its head, or auto (a cluster started on this host)",
    )
    namespace: str | None = Field(
        default=None,
        description="Ray namespace of the run's actors (null: jetctl-<run.name>); `up --resume` "
        "and `down` find the actors there",
    )
    runtime_env: dict[str, object] = Field(
        default={},
        description="Ray runtime environment of every actor (pip, working_dir, env_vars, ...); "
        "jetctl must be importable in it",
    )
    work_dir: str = Field(
        default="/tmp/jetctl",
        description="folder on each Ray host where its nodes keep their spools and logs",
    )


TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
# tracker -> (the module it needs, the pip line that installs it); jetctl.trackers uses them
TRACKER_MODULES: dict[str, str] = {
    "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio",
}


class TrackerConfig(_Strict):
    """One experiment tracker of `run.trackers`: a name, or a mapping with its options."""

    name: TrackerName
    project: str | None = Field(
        default=None,
        description="W&B project, MLflow experiment or trackio project (null: run.name)",
    )
    mode: Literal["online", "offline"] | None = Field(
        default=None, description="wandb only: offline writes run files and needs no network",
    )
    dir: str | None = Field(
        default=None,
        description="where it writes (null: <run dir>/trackers/<name>; trackio: its own store "
        "unless set)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _usable(self) -> TrackerConfig:
        problems = []
        if self.mode is not None and self.name != "wandb":
            problems.append(Problem(("mode",), self.mode, "is a wandb option: remove it"))
        # find_spec, not import: the trackers are heavy, and the recipe imports light
        if importlib.util.find_spec(TRACKER_MODULES[self.name]) is None:
            problems.append(
                Problem(
                    ("name",), self.name,
                    f"is not installed: pip install 'jetctl[trackers]' "
                    f"(or pip install {TRACKER_MODULES[self.name]})",
                )
            )
        _raise_problems(problems)
        return self


class TracingConfig(_Strict):
    """`run.tracing`: OpenTelemetry traces of every rollout, sent to an OTLP gRPC collector."""

    otlp_endpoint: str = Field(
        description="host:port of the collector's OTLP gRPC receiver (Jaeger, Grafana Tempo, "
        "an OpenTelemetry Collector), e.g. localhost:4317; https://host:port for TLS (no "
        "run.tracing: no traces)",
    )

    @model_validator(mode="after")
    def _usable(self) -> TracingConfig:
        problems = []
        address = self.otlp_endpoint.removeprefix("http://").removeprefix("https://")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            problems.append(Problem(
                ("otlp_endpoint",), self.otlp_endpoint,
                "is not host:port: give the collector's OTLP gRPC address, e.g. localhost:4317",
            ))
        # find_spec, not import: the recipe imports light (jetctl.tracing imports it when on)
        if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
            problems.append(Problem(
                ("otlp_endpoint",), self.otlp_endpoint,
                "needs the OpenTelemetry SDK and its OTLP exporter: "
                "pip install 'jetctl[tracing]'",
            ))
        _raise_problems(problems)
        return self


class RunConfig(_Strict):
    name: str = Field(default="run", description="run name; names the run directory")
    dir: str | None = Field(default=None, description="run directory (null: runs/<name>)")
    token: str | None = Field(
        default=None,
        description="bearer token of every RPC (null: generated by jetctl up, stored 0600); "
        "read a secret with ${VAR}",
    )
    tls: TlsConfig = Field(default=TlsConfig(), description="transport security")
    control: ControlConfig = Field(
        default=ControlConfig(), description="the controller's address, which every node dials"
    )
    ray: RayConfig = Field(default=RayConfig(), description="the Ray cluster (runtime: ray)")
    duration_s: float | None = Field(
        default=None, gt=0, description="stop the run after this long (null: run until jetctl down)"
    )
    restart_backoff_s: float = Field(
        default=1.0, gt=0, description="first delay before a dead process is restarted; doubles"
    )
    restart_backoff_max_s: float = Field(default=30.0, gt=0, description="cap on that delay")
    tracing: TracingConfig | None = Field(
        default=None,
        description="OpenTelemetry traces, one per rollout: the node's rollout, each model "
        "call and Generate, the env, Submit and the admission verdict, linked from the "
        "optimizer step that trained it; {otlp_endpoint: host:4317} (null: off; "
        "jetctl.tracing; pip install 'jetctl[tracing]')",
    )
    deterministic: bool = Field(
        default=False,
        description="a seed for every Generate request (from the run, node, group, "
        "trajectory and call) and each node's tasks, dataset rows included, in its seeded "
        "order (jetctl.deterministic); needs engine: hf or continuous",
    )
    trackers: list[TrackerConfig] = Field(
        default=[],
        description="experiment trackers each server sends its step rows, the recipe and a "
        "sample of each step's rollouts to: names (tensorboard, wandb, mlflow, trackio) or "
        "mappings {name, project, mode, dir} (jetctl.trackers; pip install 'jetctl[trackers]')",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> RunConfig:
        if self.restart_backoff_s > self.restart_backoff_max_s:
            _raise_problems(
                [
                    Problem(
                        ("restart_backoff_s",),
                        self.restart_backoff_s,
                        f"is more than restart_backoff_max_s ({self.restart_backoff_max_s}): "
                        "lower it or raise the cap",
                    )
                ]
            )
        return self


class Recipe(_Strict):
    run: RunConfig = Field(default=RunConfig(), description="the run as a whole")
    models: dict[str, ModelConfig] = Field(description="trainable models, one server each")
    tasks: dict[str, TaskConfig] = Field(description="tasks, one client pool each")

    @model_validator(mode="after")
    def _tasks_name_known_models(self) -> Recipe:
        task_models = {
            name: _model_refs(task.model, task.roles) for name, task in self.tasks.items()
        }
        problems = _recipe_problems(task_models, self.models, self.models, self.tasks)
        on_ray = [("models", m) for m, c in self.models.items() if c.runtime == "ray"]
        on_ray += [("tasks", t) for t, c in self.tasks.items() if c.runtime == "ray"]
        if on_ray and not self.run.ray.address:
            where = ", ".join(f"{a}.{b}" for a, b in on_ray)
            problems.append(
                Problem(
                    ("run", "ray", "address"),
                    None,
                    f"is needed by runtime: ray ({where}): give the cluster's head, e.g. "
                    "10.0.0.5:6379, or auto for a cluster started on this host",
                )
            )
        engines = {name: model.engine for name, model in self.models.items()}
        problems += _deterministic_problems(self.run.deterministic, engines)
        _raise_problems(problems)
        return self

    @property
    def uses_ray(self) -> bool:
        return any(c.runtime == "ray" for c in self.models.values()) or any(
            c.runtime == "ray" for c in self.tasks.values()
        )

    @property
    def run_dir(self) -> str:
        return self.run.dir or f"runs/{self.run.name}"
