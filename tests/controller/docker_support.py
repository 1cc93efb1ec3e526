"""What the docker tier needs: a reachable engine and the client image. Under CI=true a
missing part fails the test (CI is meant to run this tier); elsewhere it skips."""

from __future__ import annotations

import os
from typing import Any

import pytest

BASE_IMAGE = "jetctl-base"


def need(ok: bool, why: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why} (CI=true: the docker tier must run; see scripts/ci-services.sh)")
    pytest.skip(why)


def docker_or_skip(image: str | None = BASE_IMAGE) -> Any:
    """A docker SDK client of a live engine that has `image`."""
    try:
        import docker
    except ImportError:
        need(False, "the docker SDK is missing: pip install 'jetctl[docker]'")
        raise
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except docker.errors.DockerException as e:
        need(False, f"no docker engine answers: {e}")
        raise
    if image is not None:
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            need(False, f"image {image} is not built: jetctl images build --offline-base")
    return client


def containers_of(client: Any, run_dir: Any, all_: bool = True) -> list[Any]:
    found: list[Any] = client.containers.list(
        all=all_, filters={"label": [f"jetctl.run_dir={run_dir.resolve()}"]}
    )
    return found


def networks_of(client: Any, run_dir: Any) -> list[Any]:
    """The run's docker networks (runtimes/docker.py makes one per run dir)."""
    found: list[Any] = client.networks.list(
        filters={"label": [f"jetctl.run_dir={run_dir.resolve()}"]}
    )
    return found
