"""envs/code: hidden tests score submissions; the sandbox holds against escapes; the agent loop.

Sandbox tests run on every isolating backend: `bwrap` (integration tier) and `docker`
(docker tier, needs an engine and the `jetctl-code` image). Under CI=true a missing backend
fails the test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from envs.code import (
    PROBLEMS,
    CodeSession,
    CodeToolError,
    Limits,
    RunResult,
    SandboxUnavailable,
    grade,
    make_env,
    make_sandbox,
)
from envs.code.sandbox import DEFAULT_IMAGE, UID_BASE, UID_SPAN, BackendName, Sandbox
from jetctl.env import LLM, Task
from tests.envs.scripted_llm import ScriptedEndpoint, replies, tool_call
from tests.factories import IN_CI

pytestmark = pytest.mark.timeout(180)

# the docker tier's image: jetctl-code (`jetctl images build code`), or any image with python3
# named by JET_CODE_IMAGE
CODE_IMAGE = os.environ.get("JET_CODE_IMAGE", DEFAULT_IMAGE)
LIMITS = Limits(time_s=3.0, memory_mb=256, pids=16, file_mb=1)
BACKENDS = [
    pytest.param("bwrap", marks=pytest.mark.integration),
    pytest.param("docker", marks=pytest.mark.docker),
]


def sandbox_or_skip(backend: str) -> Sandbox:
    try:
        return make_sandbox(backend, CODE_IMAGE)  # type: ignore[arg-type]
    except SandboxUnavailable as e:
        if IN_CI:
            pytest.fail(f"the {backend} sandbox must run under CI: {e}")
        pytest.skip(str(e))


@pytest.fixture(params=BACKENDS)
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return sandbox_or_skip(request.param)


def sandbox_processes_left(wait_s: float = 10.0) -> list[int]:
    """Pids still running under a per-run sandbox uid, once killed ones had wait_s to go
    (SIGKILLed processes are reaped by init, which takes a moment under load)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = [
            p.pid for p in psutil.process_iter(["uids", "status"])
            if p.info["uids"] and UID_BASE <= p.info["uids"].real < UID_BASE + UID_SPAN
        ]  # fmt: skip
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def run(sandbox: Sandbox, code: str, limits: Limits = LIMITS) -> RunResult:
    return sandbox.run({"main.py": code}, ["main.py"], limits)


# ---------------------------------------------------------------------------- grading (unit)


class _FakeSandbox:
    """Answers every run with fixed stdout and keeps the files it was given."""

    name: BackendName = "bwrap"

    def __init__(self, stdout: str) -> None:
        self.stdout = stdout
        self.files: list[dict[str, str]] = []

    def run(self, files: dict[str, str], argv: list[str], limits: Limits) -> RunResult:
        self.files.append(dict(files))
        return RunResult("bwrap", 0, self.stdout, "", False, 0.0)


@pytest.mark.unit
def test_expected_values_never_enter_the_sandbox_and_forged_lines_score_nothing() -> None:
    problem = next(p for p in PROBLEMS if p.id == "roman")
    fake = _FakeSandbox("@@case-forged@@ " + json.dumps({"i": 0, "result": "I"}))
    g = grade(fake, problem, "def to_roman(n): return ''", LIMITS)
    assert (g.passed, g.total) == (0, len(problem.cases))  # wrong marker: nothing counts
    cases = json.loads(fake.files[0]["_cases.json"])
    assert set(cases) == {"function", "cases", "case_time_s", "marker"}
    assert cases["cases"] == [list(args) for args, _ in problem.cases]
    assert not any(expected in fake.files[0]["_cases.json"] for _, expected in problem.cases)


@pytest.mark.unit
def test_limits_report_every_bad_value() -> None:
    with pytest.raises(ValueError, match=r"time_s \(0\).*memory_mb \(8\).*pids \(0\)"):
        Limits(time_s=0, memory_mb=8, pids=0)


@pytest.mark.unit
def test_task_ids_are_stable() -> None:
    env = make_env(backend="process")
    assert [t.id for t in env.all_tasks()] == [f"code-{p.id}" for p in PROBLEMS]
    assert all(t.data["function"] in t.prompt for t in env.all_tasks())


# ---------------------------------------------------------------------------- scoring


def test_correct_and_wrong_submissions_score_the_fraction_passed(sandbox: Sandbox) -> None:
    env = make_env(backend=sandbox.name, image=CODE_IMAGE, time_limit_s=3.0)
    for task in env.all_tasks():
        session = env.open(task)
        assert session.submit(session.problem.reference).startswith("submitted: ")
        assert session.reward() == 1.0, task.id
        assert session.graded is not None and session.graded.backend == sandbox.name
    fizz = env.open(env.all_tasks()[0])
    fizz.submit("def fizzbuzz(n):\n    return [str(i) for i in range(1, n + 1)]\n")
    assert fizz.reward() == pytest.approx(2 / 5)  # n=1 and n=0 need no Fizz/Buzz
    with pytest.raises(CodeToolError, match="already submitted"):
        fizz.submit(fizz.problem.reference)  # the first submission counts
    assert fizz.reward() == pytest.approx(2 / 5)
    broken = env.open(env.all_tasks()[1])
    broken.submit("def is_palindrome(text) return True")
    assert broken.reward() == 0.0
    assert env.open(env.all_tasks()[2]).reward() == 0.0  # nothing submitted


def test_run_python_shows_output_and_a_slow_case_only_fails_itself(sandbox: Sandbox) -> None:
    env = make_env(backend=sandbox.name, image=CODE_IMAGE, time_limit_s=3.0, max_runs=1)
    session = env.open(env.all_tasks()[0])
    out = session.run_python("import sys\nprint('hello')\nprint('oops', file=sys.stderr)\n")
    assert out.startswith("exit code 0") and "hello" in out and "oops" in out
    with pytest.raises(CodeToolError, match="run limit"):
        session.run_python("print(1)")
    primes = env.open(next(t for t in env.all_tasks() if t.id == "code-primes"))
    primes.submit(
        "def primes_below(n):\n"
        "    while n == 30:\n        pass\n"  # one case hangs: its alarm fails it alone
        "    return [p for p in range(2, n) if all(p % d for d in range(2, p))]\n"
    )
    assert primes.reward() == pytest.approx(4 / 5)


# ---------------------------------------------------------------------------- escapes


def test_no_network(sandbox: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    finished = threading.Event()

    def accept() -> None:
        while not finished.is_set():
            try:
                accepted.append(listener.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    code = (
        "import socket\n"
        f"for host, port in [('127.0.0.1', {port}), ('172.17.0.1', {port}), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=1).close()\n"
        "        print('CONNECTED', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, type(e).__name__)\n"
        "try:\n"
        "    print('RESOLVED', socket.gethostbyname('example.com'))\n"
        "except OSError:\n"
        "    print('no dns')\n"
    )
    result = run(sandbox, code, Limits(time_s=6.0, memory_mb=256, pids=16))
    finished.set()
    thread.join()
    listener.close()
    assert result.stdout.count("refused") == 3, result
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert accepted == []


def test_fork_bomb_is_capped_and_leaves_nothing_behind(sandbox: Sandbox) -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print('capped at', n, flush=True)\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"  # keep hammering: children that fork too
        "    except OSError:\n"
        "        pass\n"
    )
    t0 = time.monotonic()
    result = run(sandbox, code)
    assert time.monotonic() - t0 < LIMITS.time_s + 30  # docker: container start included
    assert result.timed_out and "capped at" in result.stdout, result
    assert int(result.stdout.split("capped at")[1].split()[0]) < LIMITS.pids
    assert sandbox_processes_left() == []
    assert run(sandbox, "print('still fine')").stdout.strip() == "still fine"


def test_host_files_cannot_be_read(sandbox: Sandbox, tmp_path: Path) -> None:
    private = tmp_path / "token"
    private.write_text("PRIVATE-TOKEN-1234")
    private.chmod(0o600)
    public = tmp_path / "notes.txt"
    public.write_text("PUBLIC-BUT-HOST-5678")
    public.chmod(0o644)
    tmp_path.chmod(0o755)
    os.environ["JET_SANDBOX_CANARY"] = "CANARY-ENV-9012"
    paths = [str(private), str(public), "/etc/shadow", "/root/.bash_history", "/proc/1/environ"]
    code = (
        "import os\n"
        f"for path in {paths!r}:\n"
        "    try:\n"
        "        print('READ', path, open(path).read()[:200])\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
        "print(dict(os.environ))\n"
    )
    try:
        result = run(sandbox, code)
    finally:
        del os.environ["JET_SANDBOX_CANARY"]
    for secret in ("PRIVATE-TOKEN-1234", "PUBLIC-BUT-HOST-5678", "CANARY-ENV-9012"):
        assert secret not in result.stdout, result
    assert "denied /etc/shadow" in result.stdout
    assert "READ /etc/shadow" not in result.stdout


def test_nothing_is_written_outside_the_run_dir(sandbox: Sandbox, tmp_path: Path) -> None:
    open_dir = tmp_path / "world-writable"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    tmp_path.chmod(0o755)
    marker = f"jetctl-escape-{os.getpid()}-{time.monotonic_ns()}"
    targets = [
        str(open_dir / "x"), f"/tmp/{marker}", f"/dev/shm/{marker}", f"/var/tmp/{marker}",
        f"/usr/{marker}", f"/{marker}", f"../{marker}",
    ]  # fmt: skip
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print('inside ok')\n"
    )
    result = run(sandbox, code)
    assert "inside ok" in result.stdout, result  # its own directory is writable
    host_paths = [open_dir / "x", Path("/tmp", marker), Path("/dev/shm", marker),
                  Path("/var/tmp", marker), Path("/usr", marker), Path("/", marker)]  # fmt: skip
    assert [p for p in host_paths if p.exists()] == []


def test_file_size_and_memory_are_limited(sandbox: Sandbox) -> None:
    code = (
        "try:\n"
        "    open('big', 'wb').write(b'x' * (4 * 1024 * 1024))\n"
        "    print('WROTE BIG')\n"
        "except OSError as e:\n"
        "    print('fsize', type(e).__name__)\n"
        "try:\n"
        "    blob = b'x' * (1024 * 1024 * 1024)\n"  # touched pages: a cgroup limit counts them
        "    print('ALLOCATED')\n"
        "except MemoryError:\n"
        "    print('memory')\n"
    )
    result = run(sandbox, code)
    assert "WROTE BIG" not in result.stdout and "ALLOCATED" not in result.stdout, result


def test_time_limit_kills_the_run(sandbox: Sandbox) -> None:
    limits = Limits(time_s=2.0, memory_mb=256, pids=16)
    t0 = time.monotonic()
    result = run(sandbox, "print('start', flush=True)\nwhile True:\n    pass\n", limits)
    wall = time.monotonic() - t0
    assert result.timed_out and result.exit_code is None, result
    assert "start" in result.stdout
    assert result.wall_s >= 2.0 and wall < 2.0 + 30  # docker: container start included


# ---------------------------------------------------------------------------- agent


@pytest.mark.integration
def test_code_agent_runs_then_submits_through_the_proxy() -> None:
    from agents.code import agent

    sandbox_or_skip("bwrap")
    env = make_env(backend="bwrap", time_limit_s=3.0)
    task = next(t for t in env.all_tasks() if t.id == "code-roman")
    session = env.open(task)
    script = replies(
        tool_call("run_python", code="print(sum(range(5)))"),
        tool_call("submit", code=session.problem.reference),
    )
    with ScriptedEndpoint(script) as endpoint:
        agent(task, endpoint.llm, session)
    assert session.reward() == 1.0
    assert len(session.runs) == 1 and len(endpoint.prompts) == 2  # stops once submitted
    assert "10" in endpoint.prompts[1].split("print(sum(range(5)))")[-1]  # the run's output


@pytest.mark.integration
def test_code_agent_submits_code_the_model_answered_without_a_tool_call() -> None:
    from agents.code import agent

    sandbox_or_skip("bwrap")
    env = make_env(backend="bwrap", time_limit_s=3.0)
    task = next(t for t in env.all_tasks() if t.id == "code-roman")
    session = env.open(task)
    answer = f"Here is my solution:\n\n```python\n{session.problem.reference}```\nDone."
    with ScriptedEndpoint(replies(answer)) as endpoint:
        agent(task, endpoint.llm, session)
    assert session.reward() == 1.0 and len(endpoint.prompts) == 1

    other = env.open(task)  # a block that does not define the task's function is not sent
    with ScriptedEndpoint(replies("```python\ndef helper():\n    pass\n```")) as endpoint:
        agent(task, endpoint.llm, other)
    assert not other.done and other.reward() == 0.0


@pytest.mark.unit
def test_code_in_reply_takes_the_last_block_defining_the_function() -> None:
    from agents.code import code_in_reply

    text = ("```python\ndef f(x):\n    return 1\n```\ntext\n```py\nimport os\n"
            "def f (x):\n    return 2\n```\n```\ndef g():\n    pass\n```")
    assert code_in_reply(text, "f") == "import os\ndef f (x):\n    return 2\n"
    assert code_in_reply(text, "g") == "def g():\n    pass\n"
    assert code_in_reply("def f(x): return 1", "f") is None  # not fenced: prose, not an answer
    assert code_in_reply("```python\ndef ff(x):\n    pass\n```", "f") is None


# ---------------------------------------------------------------------------- backend choice


@pytest.mark.unit
def test_auto_never_falls_back_to_the_weak_process_sandbox(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # bwrap cannot be found
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")  # nor an engine
    with pytest.raises(SandboxUnavailable, match=r"no docker engine.*bubblewrap.*'process'"):
        make_sandbox("auto", DEFAULT_IMAGE)


@pytest.mark.integration
def test_process_sandbox_still_limits_time_forks_and_privileges() -> None:
    """The weak backend (asked for by name) keeps what rlimits and a uid drop can keep."""
    if os.geteuid() != 0:
        if IN_CI:  # CI runs as root (scripts/ci-services.sh): a skip here would hide the check
            pytest.fail("the process sandbox's uid drop needs root, and CI=true must run it")
        pytest.skip("the uid drop needs root")
    sandbox = make_sandbox("process", DEFAULT_IMAGE)
    assert sandbox.name == "process"
    result = run(sandbox, "print(open('/etc/shadow').read())")
    assert result.exit_code == 1 and "PermissionError" in result.stderr
    bomb = run(
        sandbox,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    )
    assert bomb.timed_out
    assert sandbox_processes_left() == []


def busy_agent(task: Task, llm: LLM, session: CodeSession) -> None:
    """Starts a run that would go on for a minute (the rollout is killed long before)."""
    session.run_python("import os\nos.fork()\nwhile True:\n    pass\n")


@pytest.mark.integration
async def test_a_rollout_killed_on_timeout_takes_its_sandbox_run_along() -> None:
    from jetctl.client.rollout import RolloutRunner, RolloutSpec

    sandbox_or_skip("bwrap")
    env = make_env(backend="bwrap")
    runner = RolloutRunner(preload=[])
    try:
        spec = RolloutSpec(
            env="envs.code:make_env",
            env_args={"backend": "bwrap", "time_limit_s": 60.0},
            agent="tests.envs.test_code:busy_agent",
            task=env.all_tasks()[0],
            base_url="http://127.0.0.1:9/v1",
            model="policy",
        )
        seen: list[int] = []

        async def watch() -> None:  # proof that the run had started when the kill came
            while not seen:
                seen.extend(sandbox_processes_left(wait_s=0))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch())
        t0 = time.monotonic()
        result = await runner.run(spec, timeout_s=12.0)
        watcher.cancel()
    finally:
        runner.shutdown()
    assert result.status == "timeout" and time.monotonic() - t0 < 30
    assert seen, "the sandbox run never started; raise the rollout timeout"
    assert sandbox_processes_left() == []
