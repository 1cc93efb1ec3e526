"""The server's start-up checks that need no server: a CUDA device the recipe names must exist."""

from __future__ import annotations

import pytest
import torch

from jetctl.recipe import GenerationConfig, ModelConfig
from jetctl.server.app import check_devices

pytestmark = pytest.mark.unit


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="this machine has the GPUs named here")
@pytest.mark.parametrize(
    ("fields", "key"),
    [({"device": "cuda:9"}, "device"), ({"generation": GenerationConfig(device="cuda:9")},
                                         "generation.device")],
)
def test_a_cuda_device_this_machine_lacks_is_one_clear_line(fields: dict[str, object], key: str) -> None:
    cfg = ModelConfig(model="builtin:tiny", **fields)  # type: ignore[arg-type]
    with pytest.raises(SystemExit) as caught:
        check_devices("policy", cfg)
    message = str(caught.value)
    assert message.startswith(f"models.policy.{key}: 'cuda:9', but torch")
    assert "use device: cpu" in message


def test_cpu_needs_no_check() -> None:
    check_devices("policy", ModelConfig(model="builtin:tiny"))
