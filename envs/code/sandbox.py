"""Run untrusted Python in a fresh sandbox per run: docker, bubblewrap, or a plain process.

Every backend gets the same `Limits` and returns a `RunResult` naming the backend that ran:

- `docker`: a fresh `docker run --rm --network none --read-only --memory --pids-limit
  --cap-drop ALL --user 65534` container per run; only the run's directory is writable
  (mounted at /work). Needs a reachable engine and the image (`images/code`).
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

stdout/stderr go to files outside the sandbox capped by RLIMIT_FSIZE (docker: read back with
a byte cap), so a flood of output cannot fill the host's memory. A run past `time_s` is
killed whole (pid namespace / container / process group) and reported as `timed_out`.
Left out: GPU access, packages beyond the standard library (docker: what the image has).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
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


class DockerSandbox:
    """A fresh locked-down container per run (see the module docstring)."""

    name: BackendName = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE) -> None:
        problem = docker_problem(image)
        if problem:
            raise SandboxUnavailable(problem)
        self.image = image

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        name = f"jetctl-code-{secrets.token_hex(6)}"
        with tempfile.TemporaryDirectory(prefix="jetctl-code-") as tmp:
            workdir = Path(tmp) / "work"
            workdir.mkdir()
            _write_files(workdir, files, 65534)
            cpu = int(limits.time_s) + 1
            cmd = [
                "docker", "run", "--rm", "--name", name,
                "--network", "none", "--read-only",
                "--memory", f"{limits.memory_mb}m", "--memory-swap", f"{limits.memory_mb}m",
                "--pids-limit", str(limits.pids), "--cpus", "1",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                "--user", "65534:65534",
                "--ulimit", f"fsize={limits.file_mb * 1024 * 1024}",
                "--ulimit", f"cpu={cpu}:{cpu + 1}",
                "--tmpfs", "/tmp:rw,size=16m,mode=1777",
                "-v", f"{workdir}:/work:rw", "-w", "/work",
                "-e", "HOME=/work", "-e", "TMPDIR=/work", "-e", "PYTHONDONTWRITEBYTECODE=1",
                self.image,
                # the container limits itself too, in case this process is killed first
                "timeout", "-s", "KILL", f"{limits.time_s:g}", "python3", *argv,
            ]  # fmt: skip
            t0 = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, stdin=subprocess.DEVNULL, capture_output=True, check=False,
                    timeout=limits.time_s + 30 + KILL_GRACE_S,  # container start is not run time
                )  # fmt: skip
            except subprocess.TimeoutExpired:
                subprocess.run(
                    ["docker", "kill", name], capture_output=True, check=False, timeout=30
                )
                raise
            wall = time.monotonic() - t0
            # `timeout -s KILL` exits 137; docker itself uses 125-127 for its own failures
            if proc.returncode in (125, 126, 127) and b"docker" in proc.stderr[:500].lower():
                raise SandboxUnavailable(
                    f"docker run failed: {proc.stderr.decode(errors='replace')[:500]}"
                )
            # 137 is also the OOM killer's mark: a timeout is one that ran the whole limit
            timed_out = proc.returncode == 137 and wall >= limits.time_s
            return RunResult(
                backend="docker",
                exit_code=None if timed_out else proc.returncode,
                stdout=proc.stdout[: limits.output_chars * 4].decode(errors="replace")[
                    : limits.output_chars
                ],
                stderr=proc.stderr[: limits.output_chars * 4].decode(errors="replace")[
                    : limits.output_chars
                ],
                timed_out=timed_out,
                wall_s=wall,
            )


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
    if shutil.which("docker") is None:
        return "docker CLI not found: apt-get install -y docker.io"
    info = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=30)
    if info.returncode != 0:
        return "no docker engine reachable: start one (dockerd --data-root DIR &)"
    inspect = subprocess.run(
        ["docker", "image", "inspect", image], capture_output=True, check=False, timeout=30
    )
    if inspect.returncode != 0:
        return (
            f"docker image {image!r} not found: build it with "
            "`jetctl images build code --offline-base` (or name another image)"
        )
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
