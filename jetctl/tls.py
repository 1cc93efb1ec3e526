"""TLS and mutual TLS for every gRPC link of a run (servers, clients, the controller, the CLI).

The recipe says `run.tls: {mode: off | tls | mtls, cert_dir: ...}`. With `cert_dir` null,
`jetctl up` makes a run CA, a server certificate (SAN: 127.0.0.1, ::1, localhost, this
host's name, every `models.<m>.host` and `.advertise`, `run.control.host` and `.advertise`,
and `run.tls.hosts`) and a client certificate in
`<run dir>/tls/` (keys mode 0600); otherwise the user's files are read from `cert_dir`
under the same names:

    ca.pem        the CA that signed both certificates (clients and servers trust it)
    server.pem    server.key    presented by swarm servers and the controller
    client.pem    client.key    presented by client nodes, the controller and the CLI (mtls)

`tls` encrypts and authenticates the server; `mtls` also makes every caller show a
certificate signed by the run CA (`require_client_auth=True`). The bearer token is still
required on every RPC but health. A refused handshake never reaches the application
(gRPC's core drops the connection before any call exists), so it is not counted among
the refused calls; the client sees UNAVAILABLE.

Left out: certificate rotation while a run is up, and revocation.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from jetctl.rundir import RunPaths

# how a node dials, when the controller starts it (the CLI's --tls / --tls-dir)
TLS_MODE_ENV = "JETCTL_TLS_MODE"
TLS_DIR_ENV = "JETCTL_TLS_DIR"

if TYPE_CHECKING:
    import grpc

    from jetctl.recipe import Recipe, TlsConfig

TlsMode = Literal["tls", "mtls"]
CA_CERT = "ca.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client.key"
VALID_DAYS = 365
DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")


class TlsError(Exception):
    """TLS material that is missing or unusable; the message says what to do."""


@dataclass(frozen=True)
class TlsFiles:
    """Where a run's TLS material lives and which mode it is used in."""

    mode: TlsMode
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / CA_CERT

    @property
    def server_cert(self) -> Path:
        return self.dir / SERVER_CERT

    @property
    def server_key(self) -> Path:
        return self.dir / SERVER_KEY

    @property
    def client_cert(self) -> Path:
        return self.dir / CLIENT_CERT

    @property
    def client_key(self) -> Path:
        return self.dir / CLIENT_KEY

    def needed(self, side: Literal["server", "client"]) -> list[Path]:
        """The files one side reads in this mode."""
        if side == "server":
            return [self.server_cert, self.server_key] + ([self.ca] if self.mode == "mtls" else [])
        return [self.ca] + ([self.client_cert, self.client_key] if self.mode == "mtls" else [])

    def check(self, side: Literal["server", "client"]) -> None:
        missing = [str(p) for p in self.needed(side) if not p.is_file()]
        if missing:
            raise TlsError(
                f"run.tls.mode is {self.mode} but {', '.join(missing)} is missing: `jetctl up` "
                "makes them when run.tls.cert_dir is null, else put yours there"
            )

    def server_credentials(self) -> grpc.ServerCredentials:
        """For `add_secure_port`; mtls refuses any caller without a certificate of the CA."""
        import grpc

        self.check("server")
        mtls = self.mode == "mtls"
        return grpc.ssl_server_credentials(
            [(self.server_key.read_bytes(), self.server_cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if mtls else None,
            require_client_auth=mtls,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For `secure_channel`: trust the run CA; in mtls also present the client cert."""
        import grpc

        self.check("client")
        if self.mode == "mtls":
            return grpc.ssl_channel_credentials(
                root_certificates=self.ca.read_bytes(),
                private_key=self.client_key.read_bytes(),
                certificate_chain=self.client_cert.read_bytes(),
            )
        return grpc.ssl_channel_credentials(root_certificates=self.ca.read_bytes())

    def to_json(self) -> dict[str, str]:
        return {"mode": self.mode, "cert_dir": str(self.dir)}

    @staticmethod
    def from_json(data: object) -> TlsFiles | None:
        """The `tls` entry of run.json (None or missing: plaintext)."""
        if not isinstance(data, dict) or data.get("mode") not in ("tls", "mtls"):
            return None
        return TlsFiles(mode=data["mode"], dir=Path(str(data["cert_dir"])))


def tls_files(cfg: TlsConfig, run_dir: Path) -> TlsFiles | None:
    """The run's TLS files for `run.tls` (None when mode is off)."""
    if cfg.mode == "off":
        return None
    folder = Path(cfg.cert_dir) if cfg.cert_dir else RunPaths(Path(run_dir)).tls
    return TlsFiles(mode=cfg.mode, dir=folder.resolve())


def prepare_run_tls(
    recipe: Recipe, run_dir: Path, extra_hosts: Iterable[str] = ()
) -> TlsFiles | None:
    """What `jetctl up` does: make the run's certificates when the recipe asks for them and
    names no `cert_dir` (kept across `--resume`), or check the user's files. `extra_hosts`:
    more names the servers are dialled at (the run's docker network gateway)."""
    files = tls_files(recipe.run.tls, run_dir)
    if files is None:
        return None
    if recipe.run.tls.cert_dir is None and not all(
        p.is_file() for p in (*files.needed("server"), *files.needed("client"))
    ):
        # every name a node may dial: the servers' and the controller's binds and adverts
        control = recipe.run.control
        hosts = [*recipe.run.tls.hosts, *(m.host for m in recipe.models.values()),
                 *(m.advertise for m in recipe.models.values() if m.advertise),
                 control.host, *([control.advertise] if control.advertise else []),
                 *extra_hosts]
        generate_run_certs(files.dir, hosts)
    files.check("server")
    files.check("client")
    return files


def channel(
    target: str, tls: TlsFiles | None, options: list[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A blocking channel: secure when the run uses TLS, else plaintext."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.channel_credentials(), options=options)


def aio_channel(
    target: str, tls: TlsFiles | None, options: list[tuple[str, Any]] | None = None
) -> grpc.aio.Channel:
    """The `grpc.aio` twin of `channel`."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)


def add_port(server: Any, address: str, tls: TlsFiles | None) -> int:
    """Bind `address` on a grpc (or grpc.aio) server, with TLS when the run uses it."""
    if tls is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, tls.server_credentials()))


# --------------------------------------------------------------------------- generation


def generate_run_certs(folder: Path, hosts: Iterable[str] = ()) -> None:
    """A fresh CA, server and client certificate in `folder` (EC P-256, keys mode 0600).

    The server certificate names 127.0.0.1, ::1, localhost, this host's name and `hosts`
    (wildcard binds such as 0.0.0.0 are skipped: a client never dials them)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)  # clock skew
    until = now + dt.timedelta(days=VALID_DAYS)

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "jetctl"),
             x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("jetctl run CA")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(
        cn: str, usage: x509.ObjectIdentifier, sans: list[x509.GeneralName]
    ) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn)).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_key, server_cert = leaf(
        "jetctl server", ExtendedKeyUsageOID.SERVER_AUTH, _san_entries(hosts)
    )
    client_key, client_cert = leaf("jetctl client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    _write_cert(folder / CA_CERT, ca_cert)
    _write_cert(folder / SERVER_CERT, server_cert)
    _write_key(folder / SERVER_KEY, server_key)
    _write_cert(folder / CLIENT_CERT, client_cert)
    _write_key(folder / CLIENT_KEY, client_key)
    # the CA key is not kept: nothing signs again during a run, and a stolen CA key
    # would mint certificates for any name


def _san_entries(hosts: Iterable[str]) -> list[Any]:
    from cryptography import x509

    names: list[str] = []
    for host in (*DEFAULT_HOSTS, socket.gethostname(), *hosts):
        if host and host not in ("0.0.0.0", "::") and host not in names:
            names.append(host)
    out: list[Any] = []
    for host in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            out.append(x509.DNSName(host))
    return out


def _write_cert(path: Path, cert: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: Any) -> None:
    """PEM, unencrypted, mode 0600 before any byte lands."""
    from cryptography.hazmat.primitives import serialization

    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
