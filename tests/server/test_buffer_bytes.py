"""The server's buffer is bounded in bytes as well as in groups (`limits.max_buffer_bytes`,
issue 25): past it a group is BUSY and not stored, room made by training is used again, and
a recipe whose bound could never hold one message is refused with the values and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from jetctl.proto.convert import group_to_pb
from jetctl.recipe import RecipeError, parse_recipe
from jetctl.server.app import open_store
from tests.factories import make_group
from tests.security.server_proc import tiny_recipe

pytestmark = pytest.mark.unit


def _recipe(limits: str) -> str:
    return tiny_recipe().replace("    generation:", f"    limits: {limits}\n    generation:")


def test_past_the_byte_bound_a_group_is_busy_and_not_stored(tmp_path: Path) -> None:
    groups = [make_group(prompt=tuple(range(1, 200))) for _ in range(4)]
    payloads = [group_to_pb(g).SerializeToString() for g in groups]
    size = len(payloads[0])
    limit = max(1024, 2 * size + size // 2)  # two groups fit, not three
    assert 2 * size <= limit < 3 * size
    recipe = parse_recipe(_recipe(
        f"{{max_message_bytes: 1024, max_buffer_bytes: {limit}, max_buffer_groups: 100}}"
    ))
    store = open_store(tmp_path / "store.sqlite", recipe.models["policy"])
    store.open(trained_through_step=0)
    outcomes = [store.put(g, p).result(5) for g, p in zip(groups, payloads)]
    assert [o.outcome for o in outcomes] == ["accepted", "accepted", "busy", "busy"]
    assert "limits.max_buffer_bytes" in outcomes[-1].reason, outcomes[-1].reason
    assert store.buffer_bytes == 2 * size and store.recorded(groups[2].id) is None
    taken = store.take(1, timeout_s=0.1)
    assert store.buffer_bytes == size
    store.give_back(taken)  # not trained after all: its bytes count again
    assert store.put(groups[2], payloads[2]).result(5).outcome == "busy"
    store.mark_trained([s.id for s in store.take(1, timeout_s=0.1)], step=1)
    assert store.put(groups[2], payloads[2]).result(5).outcome == "accepted"
    store.close()
    again = open_store(tmp_path / "store.sqlite", recipe.models["policy"])
    assert again.open(trained_through_step=1) == 2
    assert again.buffer_bytes == 2 * size, "a restart counts the reloaded buffer's bytes"
    again.close()


def test_a_byte_bound_below_one_message_is_refused_with_the_fix() -> None:
    with pytest.raises(RecipeError) as err:
        parse_recipe(_recipe("{max_message_bytes: 4096, max_buffer_bytes: 2048}"))
    text = str(err.value)
    assert "max_buffer_bytes (2048) is below max_message_bytes (4096)" in text, text
    assert "at least 4096" in text
