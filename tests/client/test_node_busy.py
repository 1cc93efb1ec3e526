"""A server whose buffer is full acks BUSY: the node keeps the group spooled and resends it
until it is accepted; nothing is dropped and BUSY is never recorded as an outcome."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jetctl.client.spool import Spool
from jetctl.proto._gen import swarm_pb2 as pb
from tests.client.client_fakes import FakeSwarm
from tests.client.test_client_node import FAKES, run_node

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
async def test_busy_acks_are_resent_until_accepted_and_nothing_is_lost(
    tokenizer: Any, tokenizer_files: dict[str, bytes], tmp_path: Path
) -> None:
    busy_left = [4]  # the first four acks say the buffer is full

    def ack(_g: pb.TrajectoryGroup) -> int:
        if busy_left[0] > 0:
            busy_left[0] -= 1
            return pb.Ack.BUSY
        return pb.Ack.ACCEPTED

    fake = FakeSwarm(tokenizer, tokenizer_files, ack_code=ack)
    node = await run_node(tmp_path, fake, 2, agent=f"{FAKES}:async_agent", group_size=2)
    spool = Spool(tmp_path / "spool" / "t-0.sqlite")
    sent = [gid for call in fake.submit_calls for gid in call]
    assert busy_left == [0] and len(sent) >= 2 + 4, "every BUSY group was sent again"
    assert len(fake.stored) == 2 and spool.depth() == 0
    assert {spool.outcome(gid) for gid in fake.stored} == {("accepted", "")}
    assert node.stats.acks == {"accepted": 2} and not node.stats.dropped
    assert spool.counts().outcomes["accepted"] == 2
