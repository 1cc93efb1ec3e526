"""Tasks from a dataset file, scored by a reward function: no env code to write.

In a recipe:

    tasks:
      word_problems:
        env: jetctl.envs.dataset:make_env
        agent: jetctl.envs.dataset:chat_agent      # one reply per row; or your own agent
        env_args:
          path: data/word_problems.jsonl           # .jsonl/.json, .csv, .parquet, or a
                                                   # `save_to_disk` folder
          test_fraction: 0.2                       # or test_path: a second file
          prompt_column: question                  # or messages_column: a chat per row,
                                                   # or prompt_template: "{question} ..."
          reward: jetctl.rewards:exact_match       # module:fn(completion, row[, messages])

The file is read through the `datasets` library (`load_dataset("json"|"csv"|"parquet")`,
`load_from_disk`). Each row becomes a `Task` whose `data["messages"]` is the opening chat
(`system`, then the `examples` exchange, then the row's prompt or messages) and whose
`data["row"]` is the whole row: every column reaches the reward. The agent sends its
reply with `session.answer(text)` (a multi-turn agent of your own may instead hand over the
whole conversation with `session.submit(messages)`); `session.reward()` calls the reward
with a timeout (`jetctl.rewards.score`), and a reward that raises fails the rollout.

Splits: `test_fraction` splits one file with a seeded `train_test_split` (the same rows on
every node and in `jetctl eval`), or `test_path` names the held-out file; `split` picks
which one this env serves (`train` for training, `test` for `jetctl eval`).

Order: epoch `e` visits every row once in the permutation seeded by `(seed, e)`
(`epoch_order`); a `Position(epoch, index)` names the `index`-th row of that permutation
(`task_at`). In a run, the client nodes of a task lease positions from the controller
(jetctl.client.rows, jetctl.controller.rows): each row is seen once per epoch across all
of them, a restarted or swapped node neither repeats nor skips one, the epoch and position
are shown in `jetctl status` and kept across `up --resume`. `epochs` stops the stream after
that many (None: endless). Without a controller (`tasks(rng)`, e.g. a node run alone),
whole epochs are walked in an order drawn from the node's rng; `shard_tasks(index, nodes)`
is a static split by node index, for tools that know both.

Left out: a node killed between spooling a group and its ack reaching the controller is
re-leased that row (jetctl.controller.rows says why).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetctl.env import LLM, Position, Task
from jetctl.rewards import score

FIRST_ROW = Position(0, 0)  # epoch 0, the first position of its permutation

SUFFIX_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DatasetError(ValueError):
    """A dataset that cannot be read or used as configured; the message says what to do."""


def read_rows(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """Every row of a JSONL / JSON / CSV / Parquet file or a `save_to_disk` folder, as dicts.
    A folder holding a `DatasetDict` needs `split` (one of its keys)."""
    import datasets

    datasets.disable_progress_bars()
    source = Path(path)
    if source.is_dir():
        loaded = datasets.load_from_disk(str(source))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DatasetError(
                    f"{source} holds the splits {sorted(loaded)}: set split to one of them"
                )
            loaded = loaded[split]
        return [dict(row) for row in loaded]
    if not source.is_file():
        raise DatasetError(f"{source} does not exist (paths are relative to where jetctl runs)")
    kind = SUFFIX_FORMATS.get(source.suffix.lower())
    if kind is None:
        raise DatasetError(
            f"{source}: unknown format {source.suffix!r}; use one of "
            f"{', '.join(SUFFIX_FORMATS)} or a save_to_disk folder"
        )
    table = datasets.load_dataset(kind, data_files=str(source), split="train")
    return [dict(row) for row in table]


def split_rows(
    rows: list[dict[str, Any]], test_fraction: float, seed: int
) -> dict[str, list[dict[str, Any]]]:
    """`train` and `test` by a seeded shuffle (the same split wherever it is computed)."""
    order = list(range(len(rows)))
    random.Random(f"split:{seed}").shuffle(order)
    n_test = round(len(rows) * test_fraction)
    if test_fraction > 0 and not 0 < n_test < len(rows):
        raise DatasetError(
            f"test_fraction {test_fraction} of {len(rows)} rows leaves an empty split"
        )
    test = sorted(order[:n_test])
    train = sorted(order[n_test:])
    return {"train": [rows[i] for i in train], "test": [rows[i] for i in test]}


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The row indices of `epoch`, in the order every node agrees on."""
    order = list(range(n_rows))
    if shuffle:
        random.Random(f"epoch:{seed}:{epoch}").shuffle(order)
    return order


@dataclass
class DatasetSession:
    """One rollout over one row: the agent's reply (or conversation) in, the reward out."""

    task: Task
    reward_fn: Callable[..., Any]
    timeout_s: float
    messages: list[dict[str, Any]] = field(default_factory=list)
    completion: str | None = None

    def answer(self, text: str) -> None:
        """The agent's final reply. Returns None: the session is done (single turn)."""
        self.completion = text
        self.messages = [*self.task.data["messages"], {"role": "assistant", "content": text}]

    def submit(self, messages: list[dict[str, Any]]) -> None:
        """A multi-turn agent's whole conversation; its last assistant message is scored."""
        replies = [m for m in messages if m.get("role") == "assistant"]
        self.messages = [dict(m) for m in messages]
        self.completion = str(replies[-1].get("content") or "") if replies else ""

    def reward(self) -> float | Mapping[str, float]:
        if self.completion is None:
            raise DatasetError(
                "the agent returned without an answer: call session.answer(text) or "
                "session.submit(messages)"
            )
        return score(self.reward_fn, self.completion, self.task.data["row"], self.messages,
                     self.timeout_s)

    def close(self) -> None:
        pass


@dataclass
class DatasetEnv:
    """Rows of one split as tasks; see the module docstring for every argument."""

    path: str
    reward: str = "jetctl.rewards:exact_match"
    reward_args: dict[str, Any] = field(default_factory=dict)
    reward_timeout_s: float = 30.0
    split: str = "train"
    test_fraction: float = 0.0
    test_path: str | None = None
    prompt_column: str = "prompt"
    prompt_template: str | None = None  # e.g. "{question} Answer as <answer>N</answer>."
    messages_column: str | None = None
    system: str | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)  # chat messages before the row
    seed: int = 0
    shuffle: bool = True
    epochs: int | None = None
    name: str = "dataset"
    _rows: list[dict[str, Any]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        problems = []
        if self.split not in ("train", "test"):
            problems.append(f"split {self.split!r} must be train or test")
        if not 0 <= self.test_fraction < 1:
            problems.append(f"test_fraction ({self.test_fraction}) must be in [0, 1)")
        if self.test_fraction and self.test_path:
            problems.append("give test_fraction or test_path, not both")
        if self.split == "test" and not (self.test_fraction or self.test_path):
            problems.append("split test needs test_fraction or test_path")
        if self.epochs is not None and self.epochs < 1:
            problems.append(f"epochs ({self.epochs}) must be at least 1 (or null: endless)")
        if self.reward_timeout_s <= 0:
            problems.append(f"reward_timeout_s ({self.reward_timeout_s}) must be positive")
        if problems:
            raise DatasetError("; ".join(problems))

    # ---------------------------------------------------------------- rows

    @property
    def rows(self) -> list[dict[str, Any]]:
        """This split's rows, read once (lazily: a rollout process never reads the file)."""
        if self._rows is None:
            if self.test_path:
                path = self.test_path if self.split == "test" else self.path
                self._rows = read_rows(path, self.split)
            elif self.test_fraction:
                self._rows = split_rows(read_rows(self.path, "train"), self.test_fraction,
                                        self.seed)[self.split]
            else:
                self._rows = read_rows(self.path, self.split)
            if not self._rows:
                raise DatasetError(f"{self.path} ({self.split}) has no rows")
            self._check_columns(self._rows[0])
        return self._rows

    def _check_columns(self, row: Mapping[str, Any]) -> None:
        if self.prompt_template and not self.messages_column:
            try:
                self.prompt_template.format(**row)
            except (KeyError, IndexError, ValueError) as exc:
                raise DatasetError(
                    f"prompt_template {self.prompt_template!r} does not fit the rows of "
                    f"{self.path} (columns: {', '.join(sorted(row))}): {exc!r}"
                ) from exc
            return
        column = self.messages_column or self.prompt_column
        if column not in row:
            kind = "messages_column" if self.messages_column else "prompt_column"
            raise DatasetError(
                f"{self.path} has no column {column!r} (columns: {', '.join(sorted(row))}): "
                f"set {kind} to one of them"
            )

    def task(self, index: int) -> Task:
        """Row `index` of this split as a task; its id `<split>-<index>` is stable."""
        row = self.rows[index]
        opening: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        opening += [dict(m) for m in self.examples]
        if self.messages_column:
            opening += [dict(m) for m in row[self.messages_column]]
            prompt = str(opening[-1].get("content", ""))
        else:
            prompt = (self.prompt_template.format(**row) if self.prompt_template
                      else str(row[self.prompt_column]))
            opening.append({"role": "user", "content": prompt})
        return Task(id=f"{self.split}-{index}", prompt=prompt,
                    data={"row": row, "messages": opening, "index": index})

    # ---------------------------------------------------------------- streams

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    def task_at(self, position: Position) -> Task:
        """The task at `position` of the epochs' permutations (the controller leases these)."""
        order = epoch_order(len(self.rows), self.seed, position.epoch, self.shuffle)
        return self.task(order[position.index])

    def shard_tasks(
        self, index: int, nodes: int, start: Position = FIRST_ROW
    ) -> Iterator[tuple[Position, Task]]:
        """Node `index` of `nodes`: the positions `p % nodes == index` of each epoch's
        permutation, from `start` on, with the position of each (to record and resume)."""
        if not 0 <= index < nodes:
            raise DatasetError(f"node index {index} is not in [0, {nodes})")
        epoch, first = start.epoch, start.index
        while self.epochs is None or epoch < self.epochs:
            order = epoch_order(len(self.rows), self.seed, epoch, self.shuffle)
            for p in range(first, len(order)):
                if p % nodes == index:
                    yield Position(epoch, p), self.task(order[p])
            epoch, first = epoch + 1, 0

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        """Whole epochs, each in an order drawn from `rng` (the node's; without a controller)."""
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            order = list(range(len(self.rows)))
            if self.shuffle:
                rng.shuffle(order)
            for i in order:
                yield self.task(i)
            epoch += 1

    def open(self, task: Task) -> DatasetSession:
        return DatasetSession(task, self.reward_fn(), self.reward_timeout_s)

    def reward_fn(self) -> Callable[..., Any]:
        """The reward named by `reward` (a factory called with `reward_args` when given)."""
        from jetctl.client.rollout import load_object

        fn = load_object(self.reward)
        return fn(**self.reward_args) if self.reward_args else fn  # type: ignore[no-any-return]


def make_env(**env_args: Any) -> DatasetEnv:
    """The dataset env (see the module docstring for its arguments)."""
    known = set(DatasetEnv.__dataclass_fields__) - {"_rows", "name"}
    unknown = sorted(set(env_args) - known)
    if unknown:
        raise DatasetError(
            f"unknown env_args {unknown} for jetctl.envs.dataset; known: {', '.join(sorted(known))}"
        )
    if "path" not in env_args:
        raise DatasetError("env_args.path is required: the dataset file or save_to_disk folder")
    return DatasetEnv(**env_args)


def chat_agent(task: Task, llm: LLM, session: Any) -> None:
    """The built-in single-turn agent: the row's opening chat in, one reply out (sampling
    from the recipe's `sampling:`)."""
    client = llm.client()
    response = client.chat.completions.create(model=llm.model, messages=task.data["messages"])
    session.answer(response.choices[0].message.content or "")
