"""Fakes for the client tests: a real grpc.aio Swarm server with scripted behaviour, and
tiny envs/agents that rollout processes import as `tests.client.client_fakes:...`
(forkserver children inherit the test process's sys.path, but not environment variables set
after the forkserver started: pass test settings through env_args).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from jetctl.auth import bearer
from jetctl.env import LLM, Task
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc as pb_grpc

TOKEN = "test-token"


def tiny_tokenizer_files() -> dict[str, bytes]:
    """builtin:tiny's tokenizer files without building the model."""
    from jetctl.models import TOKENIZER_FILE_NAMES, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        return {
            p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.name in TOKENIZER_FILE_NAMES
        }


@dataclass
class FakeSwarm(pb_grpc.SwarmServicer):
    """A Swarm server: Generate answers `reply_text` (tokenized, then EOS); Submit stores groups
    and acks them with `ack_code(group)`. `submit_faults` is consumed one per Submit call:
    "unavailable" (refuse), "drop" (store, then fail as if the reply was lost), None (normal)."""

    tokenizer: Any
    tokenizer_files: dict[str, bytes]
    model: str = "policy"
    version: int = 0
    max_context_tokens: int = 512
    max_message_bytes: int = 4 * 1024 * 1024
    reply_text: Callable[[list[int]], str] = lambda _prompt: "7777"
    ack_code: Callable[[pb.TrajectoryGroup], int] = lambda _g: pb.Ack.ACCEPTED
    submit_faults: list[str | None] = field(default_factory=list)
    generate_delay_s: float = 0.0
    submit_delay_s: float = 0.0  # each Submit waits this long before it stores and acks
    load: pb.Load | None = None  # what each Generate reply says of the server's load
    generate_cancelled: int = 0  # Generate calls their caller cancelled while they waited
    stored: dict[str, pb.TrajectoryGroup] = field(default_factory=dict)
    submit_calls: list[list[str]] = field(default_factory=list)  # group ids per call
    submit_times: list[float] = field(default_factory=list)
    generate_calls: list[pb.GenerateRequest] = field(default_factory=list)
    registers: list[pb.RegisterRequest] = field(default_factory=list)
    weights: list[pb.WeightsChunk] = field(default_factory=list)  # PullWeights answers these

    def _auth(self, context: grpc.aio.ServicerContext) -> bool:
        return dict(context.invocation_metadata()).get("authorization") == bearer(TOKEN)[0][1]

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterReply:
        if not self._auth(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        self.registers.append(request)
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        return pb.RegisterReply(
            model=self.model,
            model_source="builtin:tiny",
            model_version=self.version,
            max_staleness=4,
            max_message_bytes=self.max_message_bytes,
            max_context_tokens=self.max_context_tokens,
            tokenizer_files=self.tokenizer_files,
            eos_token_ids=[eos],
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateReply:
        if not self._auth(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        self.generate_calls.append(request)
        if self.generate_delay_s:
            try:
                await asyncio.sleep(self.generate_delay_s)
            except asyncio.CancelledError:  # the caller cancelled its call
                self.generate_cancelled += 1
                raise
        ids = list(
            self.tokenizer.encode(
                self.reply_text(list(request.prompt_ids)), add_special_tokens=False
            )
        )
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        finish = "stop"
        if len(ids) > request.max_tokens:
            ids, finish = ids[: request.max_tokens], "length"
        return pb.GenerateReply(
            completion_ids=ids,
            completion_logprobs=[-0.5] * len(ids),
            model_version=self.version,
            finish_reason=finish,
            load=self.load,
        )

    async def Submit(
        self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> pb.SubmitReply:
        if not self._auth(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        self.submit_calls.append([g.id for g in request.groups])
        self.submit_times.append(time.monotonic())
        fault = self.submit_faults.pop(0) if self.submit_faults else None
        if self.submit_delay_s:
            await asyncio.sleep(self.submit_delay_s)
        if fault == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake outage")
        acks = []
        for g in request.groups:
            if g.id in self.stored:
                acks.append(pb.Ack(group_id=g.id, code=pb.Ack.DUPLICATE))
                continue
            code = self.ack_code(g)
            if code in (pb.Ack.ACCEPTED,):
                self.stored[g.id] = g
            acks.append(
                pb.Ack(
                    group_id=g.id,
                    code=code,
                    reason="" if code == pb.Ack.ACCEPTED else "fake refusal",
                )
            )
        if fault == "drop":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost after commit")
        return pb.SubmitReply(acks=acks, model_version=self.version)

    async def PullWeights(
        self, request: pb.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WeightsChunk]:
        if not self._auth(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        if self.weights and self.weights[0].version > request.have_version:
            for chunk in self.weights:
                yield chunk


def weight_chunks(
    version: int, kind: str, data: bytes, chunk: int = 1000, config: str = ""
) -> list[pb.WeightsChunk]:
    """A payload cut into PullWeights chunks, each carrying the sha256 of the whole."""
    digest = hashlib.sha256(data).hexdigest()
    return [
        pb.WeightsChunk(
            version=version,
            format="safetensors",
            kind=kind,
            total_bytes=len(data),
            offset=off,
            data=data[off : off + chunk],
            sha256=digest,
            adapter_config_json=config,
        )
        for off in range(0, len(data), chunk)
    ]


async def start_fake_server(
    servicer: FakeSwarm, run_dir: Path | None = None
) -> tuple[grpc.aio.Server, str]:
    """Serve on a free loopback port; write `<run_dir>/servers/<model>.json` when given."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", servicer.max_message_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
        ]
    )
    pb_grpc.add_SwarmServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    endpoint = f"127.0.0.1:{port}"
    if run_dir is not None:
        path = run_dir / "servers" / f"{servicer.model}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {"model": servicer.model, "endpoint": endpoint, "pid": os.getpid(), "version": 0}
            )
        )
    return server, endpoint


# ---------------------------------------------------------------------------- envs and agents


@dataclass
class EchoSession:
    """Reward 1.0 when the agent reported the target digit, else 0."""

    task: Task
    workdir: str = ""  # where test agents leave marker files
    max_tokens: int = 8  # what the test agents ask for
    answer: str = ""

    def submit(self, text: str) -> None:
        self.answer = text

    def reward(self) -> float:
        return 1.0 if self.answer.strip().startswith(self.task.data["digit"]) else 0.0

    def close(self) -> None:
        pass


@dataclass
class EchoEnv:
    workdir: str = ""
    max_tokens: int = 8
    name: str = "echo"

    def tasks(self, rng: random.Random) -> Iterator[Task]:
        while True:
            d = str(rng.randrange(10))
            yield Task(id=f"echo-{d}", prompt=f"Reply with the digit {d}.", data={"digit": d})

    def open(self, task: Task) -> EchoSession:
        return EchoSession(task, self.workdir, self.max_tokens)


def make_env(workdir: str = "", max_tokens: int = 8) -> EchoEnv:
    return EchoEnv(workdir, max_tokens)


async def async_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    client = llm.async_client()
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=session.max_tokens,
    )
    session.submit(reply.choices[0].message.content or "")


def bare_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    """One call that leaves every sampling knob out: the recipe's `sampling:` fills them."""
    reply = llm.client().chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task.prompt}]
    )
    session.submit(reply.choices[0].message.content or "")


def overlap_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    """Holds its rollout open for 1.5 s and records how many rollouts were running with it
    (`running-*` marker files in the workdir; the peak goes to a `peak-*` file)."""
    me = Path(session.workdir, f"running-{os.getpid()}-{time.monotonic_ns()}")
    me.touch()
    try:
        time.sleep(1.5)
        running = len(list(Path(session.workdir).glob("running-*")))
        Path(session.workdir, f"peak-{me.name}").write_text(str(running))
    finally:
        me.unlink()
    session.submit("0")


def crash_once_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    """Calls the model; the first rollout to get here (across the test) then crashes."""
    reply = llm.client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=session.max_tokens,
    )
    session.submit(reply.choices[0].message.content or "")
    try:
        fd = os.open(Path(session.workdir, "crashed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    raise ZeroDivisionError("deliberate crash in the test agent")


def hang_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    """Starts a child process, records its pid, then sleeps forever."""
    child = subprocess.Popen(["sleep", "1000"])
    Path(session.workdir, f"child-{child.pid}").touch()
    time.sleep(10_000)


def slow_agent(task: Task, llm: LLM, session: EchoSession) -> None:
    """One call, then a short sleep (keeps rollouts in flight for the drain test)."""
    reply = llm.client().chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": task.prompt}],
        max_tokens=session.max_tokens,
    )
    session.submit(reply.choices[0].message.content or "")
    time.sleep(1.0)


def first_role_agent(task: Task, llm: LLM, session: Any) -> None:
    """A team agent that calls only the first of its roles (the others never speak)."""
    role = llm.roles[0]
    reply = llm.client().chat.completions.create(
        model=role, messages=[{"role": "user", "content": task.data["prompts"][role]}],
        max_tokens=4,
    )
    session.submit(role, reply.choices[0].message.content or "")
