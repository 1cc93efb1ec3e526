"""The dataset env (jetctl/envs/dataset.py): files read through `datasets`, splits, the
order every node agrees on, disjoint shards, the built-in chat agent, and a reward that
raises failing the rollout instead of scoring zero."""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from jetctl.client.rollout import Reported, RolloutSpec, child_main
from jetctl.env import Task
from jetctl.envs.dataset import (
    DatasetEnv,
    DatasetError,
    Position,
    chat_agent,
    make_env,
    read_rows,
)
from tests.envs.scripted_llm import ScriptedEndpoint, replies

pytestmark = pytest.mark.unit

ROWS = [{"question": f"What is {i} + 1?", "answer": i + 1} for i in range(23)]


def write_jsonl(path: Path, rows: list[dict[str, Any]] = ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def env_over(tmp_path: Path, **kw: Any) -> DatasetEnv:
    return make_env(path=str(write_jsonl(tmp_path / "rows.jsonl")), prompt_column="question", **kw)


def test_every_format_reads_the_same_rows(tmp_path: Path) -> None:
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    table.to_csv(str(tmp_path / "rows.csv"))
    table.to_parquet(str(tmp_path / "rows.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    for source in ("rows.csv", "rows.parquet"):
        assert read_rows(tmp_path / source) == ROWS, source
    assert read_rows(write_jsonl(tmp_path / "rows.jsonl")) == ROWS
    assert read_rows(tmp_path / "saved", "train") == ROWS
    with pytest.raises(DatasetError, match=r"splits \['train'\]: set split"):
        read_rows(tmp_path / "saved", "test")
    with pytest.raises(DatasetError, match="unknown format '.txt'"):
        (tmp_path / "rows.txt").write_text("x")
        read_rows(tmp_path / "rows.txt")


def test_a_test_fraction_holds_out_the_same_rows_every_time(tmp_path: Path) -> None:
    train = env_over(tmp_path, test_fraction=0.25).rows
    test = env_over(tmp_path, test_fraction=0.25, split="test").rows
    assert len(test) == 6 and len(train) == 17
    assert sorted(r["answer"] for r in train + test) == [r["answer"] for r in ROWS]
    assert env_over(tmp_path, test_fraction=0.25, split="test").rows == test


def test_a_second_file_is_the_test_split(tmp_path: Path) -> None:
    test_file = write_jsonl(tmp_path / "test.jsonl", ROWS[:3])
    env = env_over(tmp_path, test_path=str(test_file), split="test")
    assert env.rows == ROWS[:3]


def test_config_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no column 'prompt'.*set prompt_column"):
        _ = make_env(path=str(write_jsonl(tmp_path / "r.jsonl"))).rows
    with pytest.raises(DatasetError, match="unknown env_args \\['promt'\\]"):
        make_env(path="x.jsonl", promt="question")
    with pytest.raises(DatasetError, match="split test needs test_fraction or test_path"):
        make_env(path="x.jsonl", split="test")


def test_the_task_opens_with_system_examples_and_the_templated_prompt(tmp_path: Path) -> None:
    example = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    env = make_env(path=str(write_jsonl(tmp_path / "r.jsonl")), system="Be brief.",
                   examples=example, prompt_template="{question} Answer as <answer>N</answer>.",
                   shuffle=False)
    task = env.task(4)
    assert task.id == "train-4"
    assert task.data["messages"] == [
        {"role": "system", "content": "Be brief."}, *example,
        {"role": "user", "content": "What is 4 + 1? Answer as <answer>N</answer>."},
    ]
    assert task.data["row"] == ROWS[4]


def seen(env: DatasetEnv, index: int, nodes: int, start: Position, count: int) -> list[tuple[Position, str]]:
    stream = env.shard_tasks(index, nodes, start)
    return [(pos, task.id) for pos, task in (next(stream) for _ in range(count))]


def test_two_nodes_a_restart_and_a_swap_see_every_row_once_per_epoch(tmp_path: Path) -> None:
    env = env_over(tmp_path, epochs=2)
    n = len(ROWS)  # 23: node 0 has 12 positions per epoch, node 1 has 11
    # node 0 runs 5 tasks, is restarted at the position after its last, runs the rest
    first = seen(env, 0, 2, Position(0, 0), 5)
    last = first[-1][0]
    rest0 = [(p, t.id) for p, t in env.shard_tasks(0, 2, Position(last.epoch, last.index + 1))]
    # node 1 runs 7 tasks, then is swapped: the new node 1 starts where the old one stopped
    old1 = seen(env, 1, 2, Position(0, 0), 7)
    stop = old1[-1][0]
    new1 = [(p, t.id) for p, t in env.shard_tasks(1, 2, Position(stop.epoch, stop.index + 1))]
    everything = first + rest0 + old1 + new1
    for epoch in (0, 1):
        ids = Counter(task_id for pos, task_id in everything if pos.epoch == epoch)
        assert ids == Counter(f"train-{i}" for i in range(n)), f"epoch {epoch}"
    assert {pos.epoch for pos, _ in everything} == {0, 1}  # epochs: 2 ends the stream
    # the two epochs visit the rows in different orders, the same on every node
    order0 = [t for p, t in sorted(everything, key=lambda x: (x[0].epoch, x[0].index)) if p.epoch == 0]
    order1 = [t for p, t in sorted(everything, key=lambda x: (x[0].epoch, x[0].index)) if p.epoch == 1]
    assert order0 != order1
    assert [t for _, t in seen(env_over(tmp_path), 0, 1, Position(0, 0), n)] == order0


def test_the_chat_agent_sends_the_opening_chat_and_the_reply_is_scored(tmp_path: Path) -> None:
    env = env_over(tmp_path, shuffle=False)
    task = env.task(6)  # 6 + 1
    session = env.open(task)
    with ScriptedEndpoint(replies("I think <answer>7</answer>")) as endpoint:
        chat_agent(task, endpoint.llm, session)
        assert "What is 6 + 1?" in endpoint.prompts[0]
    assert session.completion == "I think <answer>7</answer>"
    assert session.reward() == 1.0
    wrong = env.open(task)
    wrong.answer("<answer>8</answer>")
    assert wrong.reward() == 0.0


def answer_seven(task: Task, llm: Any, session: Any) -> None:
    session.answer("<answer>7</answer>")


def raising_reward(completion: str, row: dict[str, Any]) -> float:
    raise ValueError(f"no grader for {row['question']!r}")


def rollout(env_args: dict[str, Any], task: Task) -> Any:
    """One rollout through the node's own child entry point, in a forked process."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    spec = RolloutSpec(env="jetctl.envs.dataset:make_env", env_args=env_args,
                       agent="tests.envs.test_dataset:answer_seven", task=task,
                       base_url="http://127.0.0.1:9", model="policy")
    proc = ctx.Process(target=child_main, args=(spec, writer))
    proc.start()
    writer.close()
    result = reader.recv()
    while isinstance(result, Reported):  # the spend reported so far comes before the result
        result = reader.recv()
    proc.join(30)
    return result


def test_a_reward_that_raises_fails_the_rollout_it_is_not_a_zero(tmp_path: Path) -> None:
    args = {"path": str(write_jsonl(tmp_path / "r.jsonl")), "prompt_column": "question",
            "shuffle": False}
    task = make_env(**args).task(6)
    good = rollout(args, task)
    assert (good.status, good.reward) == ("ok", 1.0)
    bad = rollout({**args, "reward": "tests.envs.test_dataset:raising_reward"}, task)
    assert bad.status == "failed"
    assert bad.error_type == "RewardError"
    assert "no grader for 'What is 6 + 1?'" in bad.error


def test_a_messages_column_and_an_agent_that_submits_the_whole_conversation(tmp_path: Path) -> None:
    rows = [{"chat": [{"role": "user", "content": "2 + 2?"}], "answer": 4}]
    env = make_env(path=str(write_jsonl(tmp_path / "chats.jsonl", rows)), messages_column="chat")
    task = env.task(0)
    assert task.prompt == "2 + 2?"
    session = env.open(task)
    session.submit([*task.data["messages"], {"role": "assistant", "content": "<answer>5</answer>"},
                    {"role": "user", "content": "Check again."},
                    {"role": "assistant", "content": "<answer>4</answer>"}])
    assert session.completion == "<answer>4</answer>"  # the last reply is scored
    assert session.reward() == 1.0
    with pytest.raises(DatasetError, match="without an answer"):
        env.open(task).reward()


def test_the_shipped_recipe_holds_out_80_of_its_400_rows() -> None:
    from jetctl.recipe import load_recipe

    root = Path(__file__).resolve().parents[2]
    task = load_recipe(root / "recipes" / "word-problems.yaml", env={}).tasks["word_problems"]
    args = {**task.env_args, "path": str(root / str(task.env_args["path"]))}
    train, test = make_env(**args), make_env(**{**args, "split": "test"})
    assert (len(train.rows), len(test.rows)) == (320, 80)
    assert not {r["question"] for r in train.rows} & {r["question"] for r in test.rows}
    task0 = test.task(0)
    assert task0.prompt.endswith("Answer as <answer>N</answer>.")
    assert len(task0.data["messages"]) == 5  # two worked exchanges, then the question
