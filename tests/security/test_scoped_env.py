"""VLLM_ALLOW_INSECURE_SERIALIZATION is never left set in the server's process: the vllm
engine sets it (with CUDA_VISIBLE_DEVICES) only while its engine core starts and while one
weight update is encoded, through `scoped_env`, which puts back what was there."""

from __future__ import annotations

import os

import pytest

from jetctl.server.engines.vllm import INSECURE_SERIALIZATION, scoped_env

pytestmark = pytest.mark.unit


def test_scoped_env_sets_for_the_block_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INSECURE_SERIALIZATION, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with scoped_env({INSECURE_SERIALIZATION: "1", "CUDA_VISIBLE_DEVICES": "1"}):
        assert os.environ[INSECURE_SERIALIZATION] == "1"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert INSECURE_SERIALIZATION not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"
    with pytest.raises(RuntimeError), scoped_env({INSECURE_SERIALIZATION: "1"}):
        raise RuntimeError("the engine failed to start")
    assert INSECURE_SERIALIZATION not in os.environ, "restored on failure too"
