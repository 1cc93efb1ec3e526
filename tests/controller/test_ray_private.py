"""runtime: ray keeps a node's keys private on its host, and out of its actor's info (issue 25).

`NodeProcess` is the actor's class; here it runs as a plain object (what Ray would run on a
host), on this machine's real filesystem, starting a real node command. The TLS files land
under `<work>/private/<node>/` (0700 directories, 0600 files), the node reads them there, and
`info()` (what `list` and `prune` read through Ray) carries neither the token nor a key. A
private directory that is a symlink, another user's, or open to others is refused, and a
symlink planted where a key goes is replaced, not followed.
"""

from __future__ import annotations

import json
import os
import stat
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


def _spec(work: Path, pems: dict[str, str]) -> dict[str, Any]:
    return {
        "name": "digits-0", "argv": [PYTHON, "-c", LIST_KEYS], "work_dir": str(work),
        "env": {"JETCTL_TOKEN": TOKEN, TLS_PEMS_ENV: json.dumps(pems)},
    }


def _run(spec: dict[str, Any]) -> NodeProcess:
    node = NodeProcess(spec)
    assert node.proc is not None and node.proc.wait(timeout=30) == 0
    return node


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_keys_are_written_private_read_by_the_node_and_kept_out_of_info(tmp_path: Path) -> None:
    work = tmp_path / "work"
    node = _run(_spec(work, PEMS))
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
    _run(_spec(work, {**PEMS, "client.key": "-----PRIVATE KEY 43-----"}))
    assert (mine / "client.key").read_text() == "-----PRIVATE KEY 43-----"
    assert _mode(mine / "client.key") == 0o600


def test_a_symlinked_private_dir_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path,
) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir(mode=0o700)
    (work / PRIVATE_DIR).symlink_to(elsewhere)
    with pytest.raises(PrivateDirError, match="not a plain directory"):
        NodeProcess(_spec(work, PEMS))
    assert list(elsewhere.iterdir()) == []


def test_a_private_dir_open_to_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / PRIVATE_DIR).mkdir(parents=True)
    os.chmod(work / PRIVATE_DIR, 0o755)
    with pytest.raises(PrivateDirError, match="chmod 700"):
        NodeProcess(_spec(work, PEMS))
    assert not (work / PRIVATE_DIR / "digits-0").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_a_private_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / PRIVATE_DIR).mkdir(parents=True, mode=0o700)
    os.chown(work / PRIVATE_DIR, 12345, 12345)
    with pytest.raises(PrivateDirError, match="owned by uid 12345"):
        NodeProcess(_spec(work, PEMS))
    assert not (work / PRIVATE_DIR / "digits-0").exists()


def test_a_symlink_planted_where_a_key_goes_is_replaced_not_followed(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _run(_spec(work, PEMS))
    mine = work / PRIVATE_DIR / "digits-0"
    target = tmp_path / "target"
    target.write_text("untouched")
    (mine / "client.key").unlink()
    (mine / "client.key").symlink_to(target)
    _run(_spec(work, PEMS))
    assert target.read_text() == "untouched"
    assert not (mine / "client.key").is_symlink() and _mode(mine / "client.key") == 0o600
    assert (mine / "client.key").read_text() == PEMS["client.key"]
