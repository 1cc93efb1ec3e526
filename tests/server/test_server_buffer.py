"""A real `jetctl server` (builtin:tiny, not training) with a bounded buffer: past
`limits.max_buffer_groups` Submit acks BUSY and stores nothing, on the unary call and the
stream alike; a resend of a stored group is still DUPLICATE."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from jetctl.auth import bearer
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc
from tests.security.server_proc import TOKEN, running_server, tiny_recipe
from tests.security.test_fuzz_server import group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LIMIT = 3
ACCEPTED, DUPLICATE, BUSY = pb.Ack.ACCEPTED, pb.Ack.DUPLICATE, pb.Ack.BUSY


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[swarm_pb2_grpc.SwarmStub, Path]]:
    run_dir = tmp_path_factory.mktemp("buffer-run")
    recipe = tiny_recipe().replace(
        "    generation:", f"    limits: {{max_buffer_groups: {LIMIT}}}\n    generation:"
    )
    with running_server(run_dir, recipe, train=False) as srv, grpc.insecure_channel(
        srv.endpoint
    ) as channel:
        yield swarm_pb2_grpc.SwarmStub(channel), run_dir


def test_past_the_bound_groups_are_busy_and_not_stored(
    served: tuple[swarm_pb2_grpc.SwarmStub, Path],
) -> None:
    stub, run_dir = served
    groups = [group(version=0) for _ in range(LIMIT + 2)]
    reply = stub.Submit(pb.SubmitRequest(groups=groups), metadata=bearer(TOKEN), timeout=30)
    assert [a.code for a in reply.acks] == [ACCEPTED] * LIMIT + [BUSY] * 2
    assert "max_buffer_groups" in reply.acks[-1].reason
    status = stub.Status(pb.StatusRequest(), metadata=bearer(TOKEN), timeout=10)
    assert status.buffer_groups == LIMIT and status.accepted_groups == LIMIT
    assert not status.rejected_groups, "BUSY is not a refusal: nothing is recorded"

    stream = stub.SubmitStream(
        iter([pb.SubmitRequest(groups=[groups[0], groups[-1]])]),
        metadata=bearer(TOKEN), timeout=30,
    )
    assert [[a.code for a in r.acks] for r in stream] == [[DUPLICATE, BUSY]]

    store = run_dir / "server-policy" / "store.sqlite"
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        ids = {row[0] for row in db.execute("SELECT id FROM groups")}
    assert ids == {g.id for g in groups[:LIMIT]}
