"""`jetctl up` with `run.tls.mode: mtls`, end to end, as a user runs it.

The controller makes the token and the run's certificates (mode 0600), its server and
client node talk mTLS, and `jetctl status` / `jetctl down` reach the controller's Control
service over mTLS. A plaintext caller, or one that knows the token but has no
certificate, is refused by the server and by the controller alike.
"""

from __future__ import annotations

import os
import stat
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
from jetctl.rundir import read_run_record
from jetctl.tls import TlsFiles
from tests.runs import detached_run, jetctl, run_status
from tests.security.server_proc import tiny_recipe

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_up_status_down_over_mtls(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    recipe = tmp_path / "mtls.yaml"
    recipe.write_text(tiny_recipe("  tls: {mode: mtls}\n  duration_s: 240", max_steps=3))
    # the run's own token file, never one from the environment
    env = {k: v for k, v in os.environ.items() if k != "JETCTL_TOKEN"}
    with detached_run(recipe, run_dir, env=env):
        doc: dict[str, Any] = {}
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            live = run_status(run_dir, env=env)
            if live is not None:
                doc = live
                if (doc["servers"][0]["accepted"] or 0) > 0:
                    break
            time.sleep(2)
        server = doc["servers"][0]
        assert (server["accepted"] or 0) > 0, f"no group reached the server over mTLS: {doc}"

        for name in ("token", "tls/server.key", "tls/client.key"):
            mode = stat.S_IMODE((run_dir / name).stat().st_mode)
            assert mode == 0o600, f"{name} has mode {oct(mode)}"
        info = read_run_record(run_dir)
        tls = TlsFiles.from_json(info.tls)
        assert tls == TlsFiles("mtls", (run_dir / "tls").resolve())
        token = (run_dir / "token").read_text().strip()

        # the controller: plaintext and certificate-less callers never get a call in
        assert info.controller is not None
        control = info.controller.endpoint
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
        down = jetctl("down", "--run-dir", str(run_dir), "--grace", "20", check=False, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert read_run_record(run_dir).state == "finished"
