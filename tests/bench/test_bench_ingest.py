"""`jetctl bench ingest` and `jetctl bench pull` end to end on builtin:tiny (short runs), and
the pieces they are built from: the request bytes the load generator makes, the modes."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from jetctl.bench.ingest import GroupMaker, Mode, parse_modes
from jetctl.cli.main import build_app
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.server.admission import Limits, check_group

TINY = Limits(model="policy", vocab_size=733, max_context_tokens=2048, max_staleness=10**6)


@pytest.mark.unit
def test_the_load_generator_sends_valid_groups_with_fresh_ids() -> None:
    maker = GroupMaker(4096)
    a, b = (pb.SubmitRequest.FromString(maker.request(3)) for _ in range(2))
    groups = list(a.groups) + list(b.groups)
    assert 3900 <= maker.size <= 4400
    assert len({g.id for g in groups}) == 6
    assert len({t.id for g in groups for t in g.trajectories}) == 24
    for g in groups:
        assert all(t.group_id == g.id for t in g.trajectories)
        assert check_group(g, TINY, 0, frozenset()).outcome == "accepted"


@pytest.mark.unit
def test_modes_parse_and_bad_ones_say_why() -> None:
    assert parse_modes("unary, stream:4") == (Mode("unary"), Mode("stream", 4))
    for text, words in (("udp", "unary or stream"), ("unary:x", "whole number"),
                        ("stream:300", "1-256"), (" , ", "at least one")):
        with pytest.raises(ValueError, match=words):
            parse_modes(text)
    result = CliRunner().invoke(build_app(), ["bench", "ingest", "--modes", "udp"])
    assert result.exit_code == 1 and "unary or stream" in result.output


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_bench_ingest_acks_durably_and_accounts_for_every_group() -> None:
    result = CliRunner().invoke(build_app(), [
        "bench", "ingest", "--seconds", "1", "--clients", "4", "--processes", "1",
        "--modes", "unary,stream:2",
    ])
    assert result.exit_code == 0, result.output
    rows = {m: re.search(rf"jetctl\s+│\s+{m}\s+│\s+([\d,]+)", result.output)
            for m in ("unary", "stream:2")}
    assert all(rows.values()), result.output
    assert all(int(r.group(1).replace(",", "")) > 0 for r in rows.values() if r)
    assert "stored == acked: yes" in result.output


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_bench_pull_verifies_full_weights_and_an_adapter() -> None:
    result = CliRunner().invoke(build_app(), [
        "bench", "pull", "--model", "builtin:tiny", "--repeats", "1", "--floor",
    ])
    assert result.exit_code == 0, result.output
    for kind in ("full", "lora"):
        for phase in ("floor", "cold", "warm"):
            assert re.search(rf"{kind}\s+│\s+{phase}", result.output), result.output
    # every row of a kind moved the same bytes as its floor
    sizes = re.findall(r"(full|lora)\s+│\s+(?:floor|cold|warm)\s+│\s+([\d.,]+)", result.output)
    assert len({s for s in sizes if s[0] == "full"}) == 1, result.output
    # a node's later pulls write into the previous pull's buffer; the new-buffer rows do not
    for kind in ("full", "lora"):
        assert re.search(rf"{kind}\s+│\s+warm\s+│(?:[^│]*│){{5}}\s+1/1\s+│", result.output), (
            result.output)
        assert re.search(rf"{kind}\s+│\s+warm, new buffer\s+│(?:[^│]*│){{5}}\s+0/1\s+│",
                         result.output), result.output
