"""runtime: ray keeps a node's keys private on its host, out of its actor's info and out of
its actor's creation arguments (issue 25).

`NodeProcess` is the actor's class; most tests here run it as a plain object (what Ray would
run on a host), on this machine's real filesystem, starting a real node command. The TLS files
land under `<work>/private/<node>/` (0700 directories, 0600 files), the node reads them there,
and `info()` (what `list` and `prune` read through Ray) carries neither the token nor a key. A
private directory that is a symlink, another user's, or open to others is refused, and a
symlink planted where a key goes is replaced, not followed. The secrets come in the actor's
`start` call, never in its spec (which Ray keeps for the actor's life): an actor made without
that call (as Ray would restart one) runs nothing. One test runs the real runtime on a local
Ray cluster: what jetctl hands Ray as creation arguments holds no token and no key, and the
node, started by the `start` call, has both, and is adopted by `list` after.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from jetctl.controller.runtimes.ray import (
    PRIVATE_DIR,
    PYTHON,
    TLS_PEMS_ENV,
    NodeProcess,
    PrivateDirError,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]  # starts node commands

TOKEN = "node-credential-0123456789"
PEMS = {"ca.pem": "-----CA CERT-----", "client.key": "-----PRIVATE KEY 42-----"}
LIST_KEYS = "import os; print('keys:', sorted(os.listdir(os.environ['JETCTL_TLS_DIR'])))"


def _spec(work: Path) -> dict[str, Any]:
    return {"name": "digits-0", "argv": [PYTHON, "-c", LIST_KEYS], "work_dir": str(work)}


def _secrets(pems: dict[str, str]) -> dict[str, str]:
    return {"JETCTL_TOKEN": TOKEN, TLS_PEMS_ENV: json.dumps(pems)}


def _run(work: Path, pems: dict[str, str]) -> NodeProcess:
    node = NodeProcess(_spec(work))
    node.start(_secrets(pems))
    assert node.proc is not None and node.proc.wait(timeout=30) == 0
    return node


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_keys_are_written_private_read_by_the_node_and_kept_out_of_info(tmp_path: Path) -> None:
    work = tmp_path / "work"
    node = _run(work, PEMS)
    private, mine = work / PRIVATE_DIR, work / PRIVATE_DIR / "digits-0"
    assert _mode(private) == 0o700 and _mode(mine) == 0o700
    for name, text in PEMS.items():
        assert _mode(mine / name) == 0o600, name
        assert (mine / name).read_text() == text
    log = (work / "logs" / "digits-0.log").read_text()
    assert "keys: ['ca.pem', 'client.key']" in log, "the node found its keys"

    shown = json.dumps(node.info())
    assert TOKEN not in shown and "PRIVATE KEY" not in shown and "CA CERT" not in shown
    assert node.info()["spec"]["name"] == "digits-0", "what list and prune need is still there"

    # a restart of the node replaces its keys (a new credential), private as before
    _run(work, {**PEMS, "client.key": "-----PRIVATE KEY 43-----"})
    assert (mine / "client.key").read_text() == "-----PRIVATE KEY 43-----"
    assert _mode(mine / "client.key") == 0o600


def test_a_symlinked_private_dir_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path,
) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir(mode=0o700)
    (work / PRIVATE_DIR).symlink_to(elsewhere)
    node = NodeProcess(_spec(work))
    with pytest.raises(PrivateDirError, match="not a plain directory"):
        node.start(_secrets(PEMS))
    assert list(elsewhere.iterdir()) == []
    assert node.poll() == (False, None), "the controller sees the node exited, and restarts it"
    assert "not a plain directory" in node.info()["error"]


def test_a_private_dir_open_to_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / PRIVATE_DIR).mkdir(parents=True)
    os.chmod(work / PRIVATE_DIR, 0o755)
    with pytest.raises(PrivateDirError, match="chmod 700"):
        NodeProcess(_spec(work)).start(_secrets(PEMS))
    assert not (work / PRIVATE_DIR / "digits-0").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_a_private_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / PRIVATE_DIR).mkdir(parents=True, mode=0o700)
    os.chown(work / PRIVATE_DIR, 12345, 12345)
    with pytest.raises(PrivateDirError, match="owned by uid 12345"):
        NodeProcess(_spec(work)).start(_secrets(PEMS))
    assert not (work / PRIVATE_DIR / "digits-0").exists()


def test_a_symlink_planted_where_a_key_goes_is_replaced_not_followed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _run(work, PEMS)
    mine = work / PRIVATE_DIR / "digits-0"
    target = tmp_path / "target"
    target.write_text("untouched")
    (mine / "client.key").unlink()
    (mine / "client.key").symlink_to(target)
    _run(work, PEMS)
    assert target.read_text() == "untouched"
    assert not (mine / "client.key").is_symlink() and _mode(mine / "client.key") == 0o600
    assert (mine / "client.key").read_text() == PEMS["client.key"]


def test_an_actor_made_without_its_start_call_runs_nothing_and_starts_once(
    tmp_path: Path,
) -> None:
    """What a restart by Ray would give (its creation arguments only): no node, no keys."""
    work = tmp_path / "work"
    node = NodeProcess(_spec(work))
    assert node.proc is None and not work.exists(), "no secrets, so nothing started"
    assert node.poll() == (True, None), "waiting for its start call, as a pending actor"
    assert node.info()["running"] is False and node.info()["started_at"] == 0.0
    node.start(_secrets(PEMS))
    assert node.proc is not None and node.proc.wait(timeout=30) == 0
    with pytest.raises(RuntimeError, match="started already"):
        node.start(_secrets(PEMS))


# what the node got, as digests: its command line is in the spec, and so no secret may be
SHOW_SECRETS = (
    "import hashlib, os, time; h = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]; "
    "print('token:', h(os.environ.get('JETCTL_TOKEN', ''))); "
    "d = os.environ['JETCTL_TLS_DIR']; "
    "print('key:', h(open(os.path.join(d, 'client.key')).read()), flush=True); "
    "time.sleep(120)"
)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _Recorder:
    """The actor class as jetctl's boundary with Ray: records each `.options(...).remote(...)`
    (what Ray keeps as the actor's creation task) and passes it on to the real class."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.created: list[tuple[dict[str, Any], tuple[Any, ...], dict[str, Any]]] = []

    def options(self, **opts: Any) -> Any:
        real, created = self.cls.options(**opts), self.created

        class _Options:
            def remote(self, *args: Any, **kwargs: Any) -> Any:
                created.append((opts, args, kwargs))
                return real.remote(*args, **kwargs)

        return _Options()


@pytest.mark.timeout(240)
def test_on_a_ray_cluster_the_creation_arguments_hold_no_secret_and_the_node_gets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray", reason="pip install 'jetctl[ray]'")
    # a local ray.init would otherwise turn on Ray's token auth and write ~/.ray/auth_token,
    # which a later `ray start --head` (tests/multihost/test_ray.py) picks up and its
    # clients, connecting to that cluster, do not
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    from jetctl.controller.runtimes.base import NodeSpec, Placement
    from jetctl.controller.runtimes.ray import RayRuntime
    from jetctl.recipe import RayConfig

    work = tmp_path / "ray"
    runtime = RayRuntime("secrets", RayConfig(namespace=f"jetctl-test-{os.getpid()}",
                                             work_dir=str(work)))
    try:
        recorder = _Recorder(runtime._actor_class)
        runtime._actor_class = recorder
        node_work = runtime.work_dir()
        key = "-----PRIVATE KEY 44-----"
        spec = NodeSpec(
            name="digits-0", kind="client", task="digits",
            argv=[PYTHON, "-c", SHOW_SECRETS],
            log_path=Path(node_work) / "logs" / "digits-0.log",
            env={"JETCTL_TOKEN": TOKEN, TLS_PEMS_ENV: json.dumps({**PEMS, "client.key": key})},
            placement=Placement(group="digits/r0", bundles=1, index=0,
                                resources=(("CPU", 0.5),), work_dir=node_work),
        )
        handle = runtime.start(spec)

        [(opts, args, kwargs)] = recorder.created
        created = json.dumps([args, kwargs], default=str)
        assert TOKEN not in created and "PRIVATE KEY" not in created and "CA CERT" not in created
        assert args[0]["name"] == "digits-0" and "env" not in args[0]
        assert opts["max_restarts"] == 0, "a restarted actor would come up without secrets"
        assert opts["max_task_retries"] == 0, "Ray keeps a retriable call's arguments"

        log = Path(node_work) / "logs" / "digits-0.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "\nkey: " not in (
            log.read_text() if log.exists() else ""
        ):
            assert runtime.poll(handle).running, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        text = log.read_text()
        assert f"token: {_digest(TOKEN)}" in text and f"key: {_digest(key)}" in text, text

        # the controller restarted (up --resume): the live node is adopted, nothing re-sent
        [adopted] = runtime.list()
        assert adopted.adopted and adopted.spec.name == "digits-0" and adopted.spec.env == {}
        assert len(recorder.created) == 1
        [(_, info)] = list(runtime._infos())
        shown = json.dumps(info)
        assert TOKEN not in shown and "PRIVATE KEY" not in shown and "CA CERT" not in shown
        runtime.kill(handle)
        assert not runtime.poll(handle).running
    finally:
        runtime.prune()
        runtime.close()
