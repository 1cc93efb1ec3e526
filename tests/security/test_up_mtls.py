"""`jetctl up` with `run.tls.mode: mtls`, end to end, as a user runs it.

The controller makes the token and the run's certificates (mode 0600), its server and
client node talk mTLS, and `jetctl status` / `jetctl down` reach the controller's Control
service over mTLS. A plaintext caller, or one that knows the token but has no
certificate, is refused by the server and by the controller alike.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from jetctl.auth import bearer
from jetctl.link import call_control
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc
from jetctl.tls import TlsFiles
from tests.security.server_proc import ROOT, tiny_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def jetctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JETCTL_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "jetctl.cli.main", *args], cwd=ROOT, capture_output=True,
        text=True, timeout=180, check=check, env=env,
    )


def test_up_status_down_over_mtls(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    recipe = tmp_path / "mtls.yaml"
    recipe.write_text(tiny_recipe("  tls: {mode: mtls}\n  duration_s: 240", max_steps=3))
    up = jetctl("up", str(recipe), "--detach", "--run-dir", str(run_dir), check=False)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            out = jetctl("status", "--run-dir", str(run_dir), "--once", "--json", check=False)
            if out.returncode == 0:
                doc = json.loads(out.stdout)
                if (doc["servers"][0]["accepted"] or 0) > 0:
                    break
            time.sleep(2)
        server = doc["servers"][0]
        assert (server["accepted"] or 0) > 0, f"no group reached the server over mTLS: {doc}"

        for name in ("token", "tls/server.key", "tls/client.key"):
            mode = stat.S_IMODE((run_dir / name).stat().st_mode)
            assert mode == 0o600, f"{name} has mode {oct(mode)}"
        info = json.loads((run_dir / "run.json").read_text())
        tls = TlsFiles.from_json(info["tls"])
        assert tls == TlsFiles("mtls", (run_dir / "tls").resolve())
        token = (run_dir / "token").read_text().strip()

        # the controller: plaintext and certificate-less callers never get a call in
        control = str(info["controller"]["endpoint"])
        req = cpb.RunStatusRequest()
        assert call_control(control, token, "Status", req, 10.0, tls=tls).run == "security"
        for wrong in (None, TlsFiles("tls", tls.dir)):
            with pytest.raises(grpc.RpcError) as e:
                call_control(control, token, "Status", req, 5.0, tls=wrong)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        # the swarm server: the same
        with grpc.insecure_channel(server["endpoint"]) as channel, pytest.raises(
            grpc.RpcError
        ) as e:
            swarm_pb2_grpc.SwarmStub(channel).Status(
                pb.StatusRequest(), metadata=bearer(token), timeout=5
            )
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        down = jetctl("down", "--run-dir", str(run_dir), "--grace", "20", check=False)
    assert down.returncode == 0, down.stdout + down.stderr
    assert json.loads((run_dir / "run.json").read_text())["state"] == "finished"
