"""TLS and mTLS from the recipe: generated certificates, and who gets through.

Real gRPC servers on loopback: the controller's Control service (cheap, no model) and a
real `jetctl server` process (builtin:tiny) in mtls mode. A client that cannot complete
the handshake gets UNAVAILABLE; one that completes it still needs the bearer token.
"""

from __future__ import annotations

import asyncio
import ipaddress
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jetctl.auth import bearer
from jetctl.client.transport import SwarmTransport
from jetctl.controller.service import serve_control
from jetctl.link import call_control
from jetctl.proto._gen import control_pb2 as cpb
from jetctl.proto._gen import swarm_pb2 as pb
from jetctl.proto._gen import swarm_pb2_grpc
from jetctl.recipe import parse_recipe
from jetctl.tls import TlsError, TlsFiles, generate_run_certs, prepare_run_tls, tls_files
from tests.security.server_proc import TOKEN, running_server, tiny_recipe

REFUSED = grpc.StatusCode.UNAVAILABLE  # a failed handshake: no call ever reaches the server


# --------------------------------------------------------------------------- certificates


@pytest.mark.unit
def test_generated_certificates_name_loopback_and_keep_keys_private(tmp_path: Path) -> None:
    generate_run_certs(tmp_path / "tls", hosts=["10.1.2.3", "trainer.internal", "0.0.0.0"])
    files = TlsFiles("mtls", tmp_path / "tls")
    for key in (files.server_key, files.client_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert not list((tmp_path / "tls").glob("ca*.key")), "the CA key is not kept"
    server = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    dns = set(san.get_values_for_type(x509.DNSName))
    assert {"127.0.0.1", "::1", "10.1.2.3"} <= ips and "0.0.0.0" not in ips
    assert {"localhost", "trainer.internal"} <= dns
    ca = x509.load_pem_x509_certificate(files.ca.read_bytes())
    for leaf in (server, x509.load_pem_x509_certificate(files.client_cert.read_bytes())):
        leaf.verify_directly_issued_by(ca)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)


@pytest.mark.unit
def test_up_makes_certificates_once_and_checks_user_files(tmp_path: Path) -> None:
    recipe = parse_recipe(tiny_recipe("  tls: {mode: mtls}"))
    files = prepare_run_tls(recipe, tmp_path)
    assert files is not None and files.dir == (tmp_path / "tls").resolve()
    before = files.server_cert.read_bytes()
    again = prepare_run_tls(recipe, tmp_path)  # jetctl up --resume keeps the run's CA
    assert again == files and files.server_cert.read_bytes() == before
    assert prepare_run_tls(parse_recipe(tiny_recipe()), tmp_path) is None

    mine = parse_recipe(tiny_recipe(f"  tls: {{mode: tls, cert_dir: {tmp_path / 'mine'}}}"))
    with pytest.raises(TlsError, match="server.pem"):
        prepare_run_tls(mine, tmp_path)


# --------------------------------------------------------------------------- Control service


class _FakeController:
    def __init__(self) -> None:
        self.token = TOKEN
        self.refused_calls: dict[str, int] = {}

    def revoked(self, node: str) -> bool:
        return False

    def status(self) -> cpb.RunStatusReply:
        return cpb.RunStatusReply(run="secure", state="running")


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    generate_run_certs(tmp_path / "tls")
    generate_run_certs(tmp_path / "other")  # another run's CA
    return tmp_path


def _control(endpoint: str, tls: TlsFiles | None, token: str = TOKEN) -> grpc.StatusCode:
    try:
        reply = call_control(endpoint, token, "Status", cpb.RunStatusRequest(), 5.0, tls=tls)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return]
    assert reply.run == "secure"
    return grpc.StatusCode.OK


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_control_service_over_mtls(certs: Path) -> None:
    mtls = TlsFiles("mtls", certs / "tls")
    server, port = serve_control(_FakeController(), TOKEN, tls=mtls)  # type: ignore[arg-type]
    endpoint = f"127.0.0.1:{port}"
    try:
        assert _control(endpoint, mtls) == grpc.StatusCode.OK
        assert _control(endpoint, mtls, token="wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert _control(endpoint, None) == REFUSED  # plaintext
        assert _control(endpoint, TlsFiles("tls", certs / "tls")) == REFUSED  # no client cert
        assert _control(endpoint, TlsFiles("mtls", certs / "other")) == REFUSED  # foreign CA
    finally:
        server.stop(grace=None)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_control_service_over_tls(certs: Path) -> None:
    tls = TlsFiles("tls", certs / "tls")
    server, port = serve_control(_FakeController(), TOKEN, tls=tls)  # type: ignore[arg-type]
    endpoint = f"127.0.0.1:{port}"
    try:
        assert _control(endpoint, tls) == grpc.StatusCode.OK  # no client cert needed
        assert _control(endpoint, TlsFiles("mtls", certs / "tls")) == grpc.StatusCode.OK
        assert _control(endpoint, None) == REFUSED
        # a server whose certificate the client's CA did not sign is not trusted
        assert _control(endpoint, TlsFiles("tls", certs / "other")) == REFUSED
    finally:
        server.stop(grace=None)


# --------------------------------------------------------------------------- swarm server


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    run_dir = tmp_path_factory.mktemp("mtls-run")
    generate_run_certs(run_dir / "tls")
    with running_server(run_dir, tiny_recipe("  tls: {mode: mtls}"), train=False) as srv:
        yield srv.endpoint, run_dir


def _generate(endpoint: str, tls: TlsFiles | None, token: str = TOKEN) -> grpc.StatusCode:
    credentials = None if tls is None else tls.channel_credentials()
    channel = (
        grpc.insecure_channel(endpoint)
        if credentials is None
        else grpc.secure_channel(endpoint, credentials)
    )
    with channel:
        stub = swarm_pb2_grpc.SwarmStub(channel)
        try:
            reply = stub.Generate(
                pb.GenerateRequest(model="policy", prompt_ids=[1, 2, 3], max_tokens=2),
                metadata=bearer(token), timeout=30,
            )
        except grpc.RpcError as e:
            return e.code()  # type: ignore[no-any-return]
    assert 1 <= len(reply.completion_ids) <= 2
    return grpc.StatusCode.OK


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_mtls_server_refuses_plaintext_and_certless_clients(mtls_server: tuple[str, Path]) -> None:
    endpoint, run_dir = mtls_server
    full = TlsFiles("mtls", run_dir / "tls")
    assert _generate(endpoint, full) == grpc.StatusCode.OK
    assert _generate(endpoint, None) == REFUSED
    assert _generate(endpoint, TlsFiles("tls", run_dir / "tls")) == REFUSED
    # mTLS does not replace the token: a trusted peer still needs it
    assert _generate(endpoint, full, token="wrong") == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(endpoint, full.channel_credentials()) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_client_transport_speaks_mtls(mtls_server: tuple[str, Path]) -> None:
    _, run_dir = mtls_server
    recipe = parse_recipe(tiny_recipe("  tls: {mode: mtls}"))
    tls = tls_files(recipe.run.tls, run_dir)

    async def go() -> tuple[pb.RegisterReply, pb.GenerateReply]:
        transport = SwarmTransport("policy", TOKEN, run_dir=run_dir, tls=tls)
        try:
            reg = await transport.register("c0", "digits", "r0")
            gen = await transport.generate(
                pb.GenerateRequest(model="policy", prompt_ids=[4, 5], max_tokens=2)
            )
        finally:
            await transport.close()
        return reg, gen

    reg, gen = asyncio.run(go())
    assert reg.model == "policy" and gen.completion_ids
