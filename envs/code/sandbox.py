"""Run untrusted Python in a fresh sandbox per run: docker, bubblewrap, or a plain process.

Every backend gets the same `Limits` and returns a `RunResult` naming the backend that ran:

- `docker`: a fresh container per run (docker SDK): `--network none`, read-only root,
  memory/pids/CPU caps, every capability dropped but SETUID/SETGID (kept for its boot
  process, pid 1, to drop the run to a random unprivileged uid), no-new-privileges. The
  files travel in the container's environment and only /work (and /tmp), tmpfs, are
  writable, so no host path is mounted: it works from the host and from a client node's
  container given the host's docker socket (recipe: `docker_socket: true`). Needs a
  reachable engine and the image (`images/code`); a run's container is removed after it,
  and exited leftovers of a killed caller (older than 10 minutes) are removed by the next
  sandbox.
- `bwrap`: bubblewrap as root: new pid/net/ipc/uts namespaces, only /usr (read-only), /proc,
  /dev, an empty /tmp and the run's directory are visible (no /etc, no /root, no run dir of
  jetctl); inside, `prlimit` sets RLIMIT_AS/CPU/NPROC/FSIZE and `setpriv` drops to a
  random unprivileged uid with no capabilities, so RLIMIT_NPROC holds and only the run's
  directory (owned by that uid) is writable.
- `process`: `unshare -n` (when it works) + the same rlimits and uid drop, in a temp
  directory with the environment cleared. It does NOT hide world-readable host files or
  world-writable directories such as /tmp, and a process that calls setsid() leaves the
  process group that a timeout kills: use it only where docker and bwrap are missing,
  and only by asking for it (`backend="process"`); `auto` never picks it.

stdout/stderr go to files outside the sandbox capped by RLIMIT_FSIZE (docker: pipes read by
pid 1 with a byte cap), so a flood of output cannot fill the host's memory. A run past `time_s` is
killed whole (pid namespace / container / process group) and reported as `timed_out`.
Left out: GPU access, packages beyond the standard library (docker: what the image has).
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, Protocol

BackendName = Literal["docker", "bwrap", "process"]
DEFAULT_IMAGE = "jetctl-code"
PYTHON = "/usr/bin/python3"  # the host's system python (bwrap/process); docker: `python3` on PATH
UID_BASE, UID_SPAN = 200_000, 100_000  # per-run uids, so concurrent runs do not share NPROC
KILL_GRACE_S = 2.0  # after the inner limit, before the outer kill (process start, teardown)


class SandboxUnavailable(RuntimeError):
    """The backend asked for cannot run here; the message says what to install or start."""


@dataclass(frozen=True)
class Limits:
    time_s: float = 5.0  # wall clock of one run
    memory_mb: int = 512  # address space (bwrap/process) or cgroup memory (docker)
    pids: int = 32  # processes and threads of the run
    file_mb: int = 8  # largest file the run may write, stdout/stderr included
    output_chars: int = 4000  # of stdout and of stderr kept in the result

    def __post_init__(self) -> None:
        problems = []
        if self.time_s <= 0:
            problems.append(f"time_s ({self.time_s}) must be positive")
        if self.memory_mb < 64:
            problems.append(f"memory_mb ({self.memory_mb}) must be at least 64 (python needs it)")
        if self.pids < 1:
            problems.append(f"pids ({self.pids}) must be at least 1")
        if self.file_mb < 1:
            problems.append(f"file_mb ({self.file_mb}) must be at least 1")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class RunResult:
    backend: BackendName
    exit_code: int | None  # None when killed at the time limit
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


class Sandbox(Protocol):
    name: BackendName

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        """Write `files` into a fresh working directory and run `python3 *argv` there."""
        ...


def _read_capped(path: Path, chars: int) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        data = f.read(chars * 4)
    return data.decode("utf-8", errors="replace")[:chars]


def _prlimit_args(limits: Limits) -> list[str]:
    cpu = int(limits.time_s) + 1
    return [
        "prlimit",
        f"--as={limits.memory_mb * 1024 * 1024}",
        f"--cpu={cpu}:{cpu + 1}",
        f"--nproc={limits.pids}",
        f"--fsize={limits.file_mb * 1024 * 1024}",
        "--core=0",
        "--",
    ]


def _setpriv_args(uid: int) -> list[str]:
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--no-new-privs",
        "--pdeathsig=KILL",
        "--",
    ]


def _write_files(workdir: Path, files: dict[str, str], uid: int | None) -> None:
    for name, text in files.items():
        path = workdir / name
        if path.parent != workdir:
            raise ValueError(f"sandbox file names must be plain names, got {name!r}")
        path.write_text(text)
        if uid is not None:
            os.chown(path, uid, uid)
    if uid is not None:
        os.chown(workdir, uid, uid)
    workdir.chmod(0o700)


def _run_host_command(
    cmd: list[str], out_dir: Path, limits: Limits, env: dict[str, str], cwd: Path | None = None
) -> tuple[int | None, bool, float]:
    """Run `cmd` with stdout/stderr to files in out_dir; SIGKILL its group past the limit."""
    t0 = time.monotonic()
    with (out_dir / "stdout").open("wb") as out, (out_dir / "stderr").open("wb") as err:
        # A process group of its own, so a timeout kills every process the run started and
        # nothing else. The rollout's group kill does not reach it: a killed rollout takes
        # the run along through bwrap's --die-with-parent (whole pid namespace) or setpriv's
        # --pdeathsig (process backend: the run's own process only).
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            env=env,
            cwd=cwd,
            process_group=0,
        )
        try:
            code: int | None = proc.wait(timeout=limits.time_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
        wall = time.monotonic() - t0
        try:  # also after a normal exit: children the run left behind go with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the group is already empty
        proc.wait()
    return code, timed_out, wall


def _result(
    backend: BackendName,
    out_dir: Path,
    code: int | None,
    timed_out: bool,
    wall: float,
    limits: Limits,
) -> RunResult:
    return RunResult(
        backend=backend,
        exit_code=code,
        stdout=_read_capped(out_dir / "stdout", limits.output_chars),
        stderr=_read_capped(out_dir / "stderr", limits.output_chars),
        timed_out=timed_out,
        wall_s=wall,
    )


class BwrapSandbox:
    """bubblewrap namespaces + rlimits + a random unprivileged uid (see the module docstring)."""

    name: BackendName = "bwrap"

    def __init__(self) -> None:
        problem = bwrap_problem()
        if problem:
            raise SandboxUnavailable(problem)

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        uid = UID_BASE + secrets.randbelow(UID_SPAN)
        with tempfile.TemporaryDirectory(prefix="jetctl-code-") as tmp:
            workdir, out_dir = Path(tmp) / "work", Path(tmp)
            workdir.mkdir()
            _write_files(workdir, files, uid)
            cmd = [
                "bwrap",
                "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try",
                "--die-with-parent", "--new-session",
                "--ro-bind", "/usr", "/usr",
                "--symlink", "usr/lib", "/lib",
                "--symlink", "usr/lib64", "/lib64",
                "--symlink", "usr/bin", "/bin",
                "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                "--bind", str(workdir), "/work", "--chdir", "/work",
                "--clearenv",
                "--setenv", "PATH", "/usr/bin:/bin",
                "--setenv", "HOME", "/work",
                "--setenv", "TMPDIR", "/work",
                "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                *_prlimit_args(limits),
                *_setpriv_args(uid),
                PYTHON, *argv,
            ]  # fmt: skip
            code, timed_out, wall = _run_host_command(cmd, out_dir, limits, env={})
            return _result("bwrap", out_dir, code, timed_out, wall, limits)


class ProcessSandbox:
    """The weak fallback (see the module docstring): asked for by name only."""

    name: BackendName = "process"

    def __init__(self) -> None:
        self._unshare = _unshare_net_works()

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        root = os.geteuid() == 0
        uid = UID_BASE + secrets.randbelow(UID_SPAN) if root else None
        with tempfile.TemporaryDirectory(prefix="jetctl-code-") as tmp:
            workdir, out_dir = Path(tmp) / "work", Path(tmp)
            workdir.mkdir()
            _write_files(workdir, files, uid)
            if uid is not None:
                Path(tmp).chmod(0o711)  # the uid can reach its dir, not list the outputs
            cmd = [
                *(["unshare", "-n", "--"] if self._unshare else []),
                *_prlimit_args(limits),
                # pdeathsig: a killed rollout takes the run along (its own forks may stay)
                *(_setpriv_args(uid) if uid is not None else ["setpriv", "--pdeathsig=KILL", "--"]),
                PYTHON, *argv,
            ]  # fmt: skip
            env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir)}
            code, timed_out, wall = _run_host_command(cmd, out_dir, limits, env, cwd=workdir)
            return _result("process", out_dir, code, timed_out, wall, limits)


# Runs as the container's pid 1 (root, no capabilities but SETUID/SETGID): writes the files,
# starts `python3 *argv` as the run's uid with rlimits, reads its output through pipes with
# a cap, kills every other process of the container at the time limit, and prints one JSON
# line, the only thing on the container's stdout (the run cannot reach pid 1's fds).
_DOCKER_BOOT = r"""
import base64, json, os, resource, signal, subprocess, sys, threading, time
spec = json.loads(base64.b64decode(os.environ.pop("JETCTL_SANDBOX")))
os.chdir("/work")
os.chmod("/work", 0o1777)  # docker makes a working dir 0755; the run's uid writes here
for name, text in spec["files"].items():
    with open(name, "w") as f:
        f.write(text)
def drop():
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize"], spec["fsize"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.setgroups([])
    os.setgid(spec["uid"])
    os.setuid(spec["uid"])
env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/work", "TMPDIR": "/work",
       "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
if os.environ.get("PYTHONPATH"):
    env["PYTHONPATH"] = os.environ["PYTHONPATH"]
cap = spec["cap"]
outs = {"stdout": bytearray(), "stderr": bytearray()}
def read(pipe, buf):
    while True:
        chunk = pipe.read1(65536)
        if not chunk:
            return
        buf += chunk[: max(0, cap - len(buf))]
t0 = time.monotonic()
child = subprocess.Popen([sys.executable, *spec["argv"]], stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         preexec_fn=drop, start_new_session=True)
readers = [threading.Thread(target=read, args=(getattr(child, k), outs[k]), daemon=True)
           for k in outs]
for r in readers:
    r.start()
try:
    code = child.wait(timeout=spec["time_s"])
    timed_out = False
except subprocess.TimeoutExpired:
    code, timed_out = None, True
wall = time.monotonic() - t0
for _ in range(3):
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != 1]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.05)
for r in readers:
    r.join(2.0)
child.poll()
result = {k: base64.b64encode(bytes(v)).decode() for k, v in outs.items()}
result.update(exit_code=code, timed_out=timed_out, wall_s=wall)
sys.stdout.write(json.dumps(result) + "\n")
sys.stdout.flush()
"""

SANDBOX_LABEL = "jetctl.sandbox"
LEFTOVER_AGE_S = 600.0  # an exited sandbox container this old has no caller reading it


def _docker_client():  # type: ignore[no-untyped-def]
    import docker

    return docker.from_env(timeout=60)


class DockerSandbox:
    """A fresh locked-down container per run (see the module docstring).

    Talks to the engine through the docker SDK (`DOCKER_HOST` or /var/run/docker.sock) and
    passes the files in the container's environment, not through a bind mount, so it works
    the same from the host and from inside a client node's container that was given the
    host's docker socket (the run's containers are then its siblings, not its children).
    """

    name: BackendName = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE) -> None:
        problem = docker_problem(image)
        if problem:
            raise SandboxUnavailable(problem)
        self.image = image
        self.client = _docker_client()
        # runs whose caller was killed before it could remove them (exited by their own
        # limit); only old ones: a concurrent rollout may be reading a fresh one's output
        # (ignore_removed: list() inspects each container, and a concurrent rollout may remove
        # one between the listing and its inspection; that was a failed rollout, 404)
        for old in self.client.containers.list(
            all=True, filters={"label": SANDBOX_LABEL, "status": "exited"}, ignore_removed=True
        ):
            if _age_s(old) > LEFTOVER_AGE_S:
                _remove(old)

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        import docker

        for file_name in files:
            if "/" in file_name or file_name in ("", ".", ".."):
                raise ValueError(f"sandbox file names must be plain names, got {file_name!r}")
        spec = {
            "files": files, "argv": argv, "time_s": limits.time_s,
            "cpu": int(limits.time_s) + 1, "fsize": limits.file_mb * 1024 * 1024,
            "uid": UID_BASE + secrets.randbelow(UID_SPAN), "cap": limits.output_chars * 4,
        }  # fmt: skip
        payload = base64.b64encode(json.dumps(spec).encode()).decode()
        if len(payload) > 100_000:  # one environment string may hold 128 KiB
            raise ValueError(f"sandbox files too large for one run ({len(payload)} bytes)")
        work_mb = max(16, limits.file_mb * 4)
        t0 = time.monotonic()
        try:
            container = self.client.containers.run(
                self.image, ["python3", "-c", _DOCKER_BOOT], entrypoint=[],
                name=f"jetctl-code-{secrets.token_hex(6)}", labels={SANDBOX_LABEL: "code"},
                environment={"JETCTL_SANDBOX": payload}, user="0:0", working_dir="/work",
                network_mode="none", read_only=True,
                tmpfs={"/work": f"rw,exec,size={work_mb}m,mode=1777",
                       "/tmp": "rw,size=16m,mode=1777"},
                mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
                pids_limit=limits.pids + 3,  # + the boot process and its two output readers
                nano_cpus=1_000_000_000, cap_drop=["ALL"], cap_add=["SETUID", "SETGID"],
                security_opt=["no-new-privileges"], detach=True,
            )  # fmt: skip
        except docker.errors.ImageNotFound:
            raise SandboxUnavailable(f"docker image {self.image!r} not found") from None
        except docker.errors.APIError as e:
            raise SandboxUnavailable(f"docker could not start the sandbox: {e}") from None
        try:
            try:
                # container start is not run time; the boot process ends the run at time_s
                container.wait(timeout=limits.time_s + 30 + KILL_GRACE_S)
            except Exception:  # noqa: BLE001  # requests' ReadTimeout: the boot process hung
                container.kill()
                container.wait(timeout=30)
            logs = container.logs(stdout=True, stderr=False)
            boot_err = container.logs(stdout=False, stderr=True)[-2000:]
        finally:
            _remove(container)
        lines = logs.decode(errors="replace").strip().splitlines()
        try:
            out = json.loads(lines[-1])
        except (IndexError, ValueError):
            # no report: the boot process itself was killed (memory) or could not start
            return RunResult(
                backend="docker", exit_code=None, stdout="",
                stderr=boot_err.decode(errors="replace"), timed_out=False,
                wall_s=time.monotonic() - t0,
            )  # fmt: skip

        def text(key: str) -> str:
            raw = base64.b64decode(out[key])
            return raw.decode(errors="replace")[: limits.output_chars]

        return RunResult(
            backend="docker",
            exit_code=out["exit_code"],
            stdout=text("stdout"),
            stderr=text("stderr"),
            timed_out=bool(out["timed_out"]),
            wall_s=float(out["wall_s"]),
        )


def _age_s(container) -> float:  # type: ignore[no-untyped-def]
    """Seconds since the container was created (0 when docker's timestamp does not parse)."""
    created = str(container.attrs.get("Created", ""))  # 2026-11-30T20:56:13.123456789Z
    head, _, frac = created.rstrip("Z").partition(".")
    try:
        when = datetime.fromisoformat(head).replace(tzinfo=timezone.utc)
    except ValueError:
        return 0.0
    return time.time() - when.timestamp() - float(f"0.{frac or 0}")


def _remove(container) -> None:  # type: ignore[no-untyped-def]
    try:
        container.remove(force=True)
    except Exception:  # noqa: BLE001, S110  # already gone (removed by a concurrent cleanup)
        pass


def bwrap_problem() -> str | None:
    """Why the bwrap backend cannot run here, or None."""
    missing = [t for t in ("bwrap", "prlimit", "setpriv") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found: apt-get install -y bubblewrap util-linux"
    if os.geteuid() != 0:
        return (
            "the bwrap backend drops to a per-run uid and needs root for that; "
            "run as root or use backend='docker'"
        )
    probe = subprocess.run(
        ["bwrap", "--unshare-net", "--unshare-pid", "--ro-bind", "/usr", "/usr",
         "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
         "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev", "/usr/bin/true"],
        capture_output=True, check=False, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"bwrap cannot create namespaces here: {probe.stderr.decode(errors='replace')[:300]}"
    return None


def docker_problem(image: str) -> str | None:
    """Why the docker backend cannot run `image` here, or None."""
    try:
        import docker
    except ImportError:
        return "the docker SDK is missing: pip install 'jetctl[docker]'"
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as e:  # noqa: BLE001  # DockerException, connection errors: same answer
        return (
            f"no docker engine reachable at {where} ({type(e).__name__}): start one "
            "(dockerd --data-root DIR &), or give the node the host's socket "
            "(docker_socket: true in the recipe's task)"
        )
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return (
            f"docker image {image!r} not found: build it with "
            "`jetctl images build code --offline-base` (or name another image)"
        )
    except docker.errors.APIError as e:
        return f"docker could not inspect image {image!r}: {e}"
    return None


def _unshare_net_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-n", "--", "/usr/bin/true"], capture_output=True, check=False
    )
    return probe.returncode == 0


def make_sandbox(backend: Literal["auto", "docker", "bwrap", "process"], image: str) -> Sandbox:
    """The backend asked for; `auto` tries docker, then bwrap, and says why neither works."""
    if backend == "docker":
        return DockerSandbox(image)
    if backend == "bwrap":
        return BwrapSandbox()
    if backend == "process":
        return ProcessSandbox()
    if backend != "auto":
        raise ValueError(f"backend ({backend!r}) must be one of auto, docker, bwrap, process")
    problems = []
    for factory in (lambda: DockerSandbox(image), BwrapSandbox):
        try:
            return factory()
        except SandboxUnavailable as e:
            problems.append(str(e))
    raise SandboxUnavailable(
        "no isolating sandbox here (docker: "
        + problems[0]
        + "; bwrap: "
        + problems[1]
        + "). backend='process' runs without file isolation if you accept that."
    )
