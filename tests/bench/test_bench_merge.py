"""`jetctl bench merge` on builtin:tiny with --quick: real workloads, real worker processes.

The unit tests check the workloads themselves (rendered with the tiny tokenizer's chat
template, append-only per timeline, the shared prefixes the tree packs once). The
integration test runs the command end to end, each (workload, mode) in its own spawned
process, and checks that the printed and saved ratios are computed from the run's own
measurements.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jetctl.bench import merge as bm
from jetctl.cli.main import build_app
from jetctl.models import load_tokenizer
from jetctl.server.merge import MergeMode, pack, timeline_sequences


@pytest.fixture(scope="module")
def workloads() -> list[bm.Workload]:
    return bm.build_workloads(load_tokenizer("builtin:tiny", progress=False), [1, 2, 3, 4],
                              quick=True)


def tokens_fed(w: bm.Workload, mode: MergeMode) -> int:
    seqs = [s for t, a in w.trajectories for s in timeline_sequences(t, a, mode)]
    return sum(mb.num_tokens for mb in pack(seqs, mode, 8192))


@pytest.mark.unit
def test_agent_timelines_are_append_only_and_merge_to_one_sequence(
    workloads: list[bm.Workload],
) -> None:
    for w, calls in zip(workloads[:2], (4, 12)):
        ((traj, _),) = w.trajectories
        assert len(traj.calls) == calls
        (seq,) = timeline_sequences(traj, 1.0, "linear")
        last = traj.calls[-1]
        assert seq.tokens == last.prompt_ids + last.completion_ids
        # the tool calls and tool responses went through the chat template
        tok = load_tokenizer("builtin:tiny", progress=False)
        text = tok.decode(seq.tokens)
        assert "<tool_call>" in text and "<tool_response>" in text


@pytest.mark.unit
def test_grpo_group_and_team_share_their_prefixes(workloads: list[bm.Workload]) -> None:
    grpo, team = workloads[2], workloads[3]
    assert len(grpo.trajectories) == 8
    prompts = {tuple(t.calls[0].prompt_ids) for t, _ in grpo.trajectories}
    assert len(prompts) == 1  # G completions of one prompt
    assert abs(sum(a for _, a in grpo.trajectories)) < 1e-6  # group-normalised advantages
    assert [len(t.calls) for t, _ in team.trajectories] == [3, 3, 3]
    assert tokens_fed(team, "off") / tokens_fed(team, "tree") >= 3
    assert tokens_fed(team, "linear") > tokens_fed(team, "tree")
    assert tokens_fed(grpo, "linear") == tokens_fed(grpo, "off")  # nothing to merge in time


@pytest.mark.integration
def test_bench_runs_and_its_ratios_come_from_its_measurements(tmp_path: Path) -> None:
    out = tmp_path / "merge.json"
    result = CliRunner().invoke(build_app(), [
        "bench", "merge", "--model", "builtin:tiny", "--quick", "--workloads", "4",
        "--json", str(out),
    ], env={"COLUMNS": "240"})  # a wide table: no wrapped headers
    assert result.exit_code == 0, result.output
    assert "jetctl bench merge" in result.output and "tokens x" in result.output
    data = json.loads(out.read_text())
    assert data["options"]["attn"] == "jetctl_tree"  # the server's kernel, the default
    cells = {(r["workload"], r["mode"]): r for r in data["results"]}
    assert set(cells) == {(4, m) for m in ("off", "linear", "tree")}
    for (w, _), r in cells.items():
        naive = cells[(w, "off")]
        assert r["tokens_naive"] == naive["tokens_naive"] == naive["tokens_fed"]
        assert r["step_s"] > 0 and r["forward_s"] > 0 and r["backward_s"] > 0
        assert r["peak_rss_mib"] >= r["base_rss_mib"] > 0
        assert r["ratios"]["tokens"] == pytest.approx(naive["tokens_fed"] / r["tokens_fed"])
        assert r["ratios"]["time"] == pytest.approx(naive["step_s"] / r["step_s"])
        assert r["ratios"]["memory"] == pytest.approx(naive["peak_rss_mib"] / r["peak_rss_mib"])
        # every mode scores the same generated tokens: only the layout differs
        assert r["scored_tokens"] == naive["scored_tokens"]
    assert cells[(4, "tree")]["ratios"]["tokens"] >= 3
    assert f"{cells[(4, 'tree')]['ratios']['tokens']:.2f}x" in result.output
    target = next(t for t in data["targets"] if t["workload"] == 4 and "tokens" in t["what"])
    assert target["reached"] == pytest.approx(cells[(4, "tree")]["ratios"]["tokens"])


@pytest.mark.unit
def test_unknown_workload_is_one_red_line() -> None:
    result = CliRunner().invoke(build_app(), ["bench", "merge", "--workloads", "1,7"])
    assert result.exit_code == 1
    assert "choose from 1, 2, 3, 4" in result.output


@pytest.mark.unit
def test_unknown_attention_is_one_red_line() -> None:
    result = CliRunner().invoke(build_app(), ["bench", "merge", "--attn", "flash"])
    assert result.exit_code == 1
    assert "choose jetctl_tree, sdpa, eager" in result.output


@pytest.mark.unit
def test_the_bench_measures_the_trainers_own_step_and_model(
    workloads: list[bm.Workload], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No copy to drift: the bench's step is the server's `step.train_step` (seen here by
    wrapping it) on the model `step.load_trainable` builds (with the server's per-thread
    LoRA switch), and its figures are that function's own."""
    from jetctl.server import step
    from jetctl.server.adapter import AdapterInput

    seen: list[step.StepResult] = []
    real = step.train_step

    def wrapped(*args: object, **kwargs: object) -> step.StepResult:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(out)
        return out

    monkeypatch.setattr(step, "train_step", wrapped)
    model = bm.trainable_model("builtin:tiny", "lora", "sdpa")
    assert any(isinstance(m, AdapterInput) for m in model.modules())
    figures = bm.train_step(model, workloads[2], "tree", 8192, clip_eps=0.2)
    assert len(seen) == 1
    assert (figures.loss, figures.scored_tokens) == (seen[0].loss, seen[0].scored_tokens)
    assert any(p.grad is not None for p in model.parameters() if p.requires_grad)
