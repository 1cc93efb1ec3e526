"""Start a real `jetctl server` process (builtin:tiny) for the security tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from jetctl.auth import write_token
from jetctl.net import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "security-test-token"

TINY = """
run:
  name: security
{run_extra}
models:
  policy:
    model: builtin:tiny
    finetune: full
    train: {{groups_per_step: 1, max_staleness: {max_staleness}, max_steps: {max_steps}}}
    generation: {{max_new_tokens: 8, max_context_tokens: 256, batch_wait_ms: 0}}
tasks:
  digits:
    env: envs.digits:make_env
    agent: agents.digits:agent
    model: policy
    group_size: 2
    concurrency: 2
    sampling: {{max_tokens: 4}}
"""


@dataclass(frozen=True)
class ServerProc:
    endpoint: str
    run_dir: Path
    proc: subprocess.Popen[bytes]

    def log(self) -> str:
        return (self.run_dir / "server.log").read_text()[-4000:]


def tiny_recipe(run_extra: str = "", max_staleness: int = 2, max_steps: int = 1000) -> str:
    return TINY.format(run_extra=run_extra, max_staleness=max_staleness, max_steps=max_steps)


@contextmanager
def running_server(run_dir: Path, recipe_text: str, *, train: bool = True) -> Iterator[ServerProc]:
    """A server on a free loopback port; SIGTERM on exit, which must exit 0 (it drains)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_token(run_dir / "token", TOKEN)
    recipe = run_dir / "recipe.yaml"
    recipe.write_text(recipe_text)
    argv = [sys.executable, "-m", "jetctl.cli.main", "server", "--recipe", str(recipe),
            "--model", "policy", "--run-dir", str(run_dir), "--port", str(free_port())]
    if not train:
        argv.append("--no-train")
    with (run_dir / "server.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    server = ServerProc("", run_dir, proc)
    endpoint_file = run_dir / "servers" / "policy.json"
    deadline = time.monotonic() + 120
    try:
        while not endpoint_file.exists():
            assert proc.poll() is None, server.log()
            assert time.monotonic() < deadline, "server did not come up: " + server.log()
            time.sleep(0.2)
        endpoint = json.loads(endpoint_file.read_text())["endpoint"]
        yield ServerProc(endpoint, run_dir, proc)
    finally:
        proc.terminate()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, server.log()
