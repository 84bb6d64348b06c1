"""TLS and mutual TLS on the gRPC port, certificates made here; metrics stay plain HTTP."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from client import PredictClient, PredictError, Tls
from tests.integration.conftest import ServerProcess, start_server

X = {"x": np.zeros((1, 2), np.int64)}


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(cert_path), str(key_path)


def make_ca(path: Path, name: str) -> tuple[str, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, _ = _write(path, key, cert)
    return cert_path, key, cert


def make_leaf(path: Path, name: str, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
              server: bool) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return _write(path, key, builder.sign(ca_key, hashes.SHA256()))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("certs")
    ca, ca_key, ca_cert = make_ca(d / "ca", "test CA")
    server_cert, server_key = make_leaf(d / "server", "localhost", ca_key, ca_cert, server=True)
    client_cert, client_key = make_leaf(d / "client", "good client", ca_key, ca_cert, server=False)
    _, rogue_ca_key, rogue_ca_cert = make_ca(d / "rogue-ca", "rogue CA")
    rogue_cert, rogue_key = make_leaf(d / "rogue", "rogue client", rogue_ca_key, rogue_ca_cert, server=False)
    return {"ca": ca, "server_cert": server_cert, "server_key": server_key, "client_cert": client_cert,
            "client_key": client_key, "rogue_cert": rogue_cert, "rogue_key": rogue_key}


def serve(model_dirs: dict[str, Path], tmp_path: Path, name: str, *flags: str) -> Iterator[ServerProcess]:
    server = start_server(["--model-base-path", str(model_dirs["echo"]), "--model-name", "echo", *flags],
                          tmp_path / f"{name}.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_server(model_dirs: dict[str, Path], certs: dict[str, str],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve(model_dirs, tmp_path_factory.mktemp("tls"), "tls",
                     "--tls-cert-file", certs["server_cert"], "--tls-key-file", certs["server_key"])


@pytest.fixture(scope="module")
def mtls_server(model_dirs: dict[str, Path], certs: dict[str, str],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from serve(model_dirs, tmp_path_factory.mktemp("mtls"), "mtls",
                     "--tls-cert-file", certs["server_cert"], "--tls-key-file", certs["server_key"],
                     "--tls-client-ca-file", certs["ca"])


def outcome(target: str, tls: Tls | None) -> str:
    try:
        with PredictClient(target, tls=tls) as client:
            client.predict("echo", X, timeout=5)
        return "OK"
    except PredictError as exc:
        return exc.code.name


def test_tls(tls_server: ServerProcess, certs: dict[str, str]) -> None:
    target = f"localhost:{tls_server.port}"
    results = {"tls": outcome(target, Tls(ca_file=certs["ca"])), "plaintext": outcome(target, None)}
    print("server TLS:", results)
    assert "tls=server" in tls_server.log()
    assert results["tls"] == "OK"
    assert results["plaintext"] == "UNAVAILABLE"
    # The REST port serves HTTPS with the same certificate, /metrics included; plain HTTP fails.
    context = ssl.create_default_context(cafile=certs["ca"])
    url = f"https://localhost:{tls_server.rest_port}"
    with urllib.request.urlopen(f"{url}/v1/models/echo", timeout=10, context=context) as response:
        assert b'"AVAILABLE"' in response.read()
    with urllib.request.urlopen(f"{url}/metrics", timeout=10, context=context) as response:
        assert b"mirrorserve_requests_total" in response.read()
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://localhost:{tls_server.rest_port}/v2/health/live", timeout=10)


def test_mutual_tls(mtls_server: ServerProcess, certs: dict[str, str]) -> None:
    target = f"localhost:{mtls_server.port}"
    results = {
        "no client certificate": outcome(target, Tls(ca_file=certs["ca"])),
        "certificate from another CA": outcome(
            target, Tls(ca_file=certs["ca"], cert_file=certs["rogue_cert"], key_file=certs["rogue_key"])),
        "certificate signed by the CA": outcome(
            target, Tls(ca_file=certs["ca"], cert_file=certs["client_cert"], key_file=certs["client_key"])),
        "plaintext": outcome(target, None),
    }
    print("mutual TLS:", results)
    assert "tls=mutual" in mtls_server.log()
    assert results == {"no client certificate": "UNAVAILABLE", "certificate from another CA": "UNAVAILABLE",
                       "certificate signed by the CA": "OK", "plaintext": "UNAVAILABLE"}
    # REST asks for the client certificate too.
    url = f"https://localhost:{mtls_server.rest_port}/v2/health/live"
    context = ssl.create_default_context(cafile=certs["ca"])
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        urllib.request.urlopen(url, timeout=10, context=context).read()
    context.load_cert_chain(certs["client_cert"], certs["client_key"])
    with urllib.request.urlopen(url, timeout=10, context=context) as response:
        assert response.status == 200
    assert mtls_server.process.poll() is None


def ssl_config(path: Path, certs: dict[str, str], client_verify: bool) -> Path:
    """TF Serving's --ssl_config_file: the PEM texts themselves, in an SSLConfig text file."""
    def pem(name: str) -> str:
        return Path(certs[name]).read_text().replace("\n", "\\n")

    path.write_text(f'server_key: "{pem("server_key")}"\nserver_cert: "{pem("server_cert")}"\n'
                    f'custom_ca: "{pem("ca")}"\nclient_verify: {str(client_verify).lower()}\n')
    return path


def test_tf_servings_ssl_config_file_secures_the_grpc_port_only(
        model_dirs: dict[str, Path], certs: dict[str, str], tmp_path: Path) -> None:
    config = ssl_config(tmp_path / "ssl.config", certs, client_verify=True)
    server = start_server(["--model-base-path", str(model_dirs["echo"]), "--model-name", "echo",
                           f"--ssl_config_file={config}", "--drain-delay-s", "0"], tmp_path / "server.log")
    try:
        target = f"localhost:{server.port}"
        results = {
            "no client certificate": outcome(target, Tls(ca_file=certs["ca"])),
            "certificate signed by custom_ca": outcome(
                target, Tls(ca_file=certs["ca"], cert_file=certs["client_cert"], key_file=certs["client_key"])),
            "plaintext": outcome(target, None),
        }
        assert results == {"no client certificate": "UNAVAILABLE", "certificate signed by custom_ca": "OK",
                           "plaintext": "UNAVAILABLE"}, results
        assert "tls=grpc-only (--ssl-config-file)" in server.log()
        # As in TF Serving, the REST port stays plain HTTP.
        with urllib.request.urlopen(f"http://127.0.0.1:{server.rest_port}/v1/models/echo", timeout=10) as response:
            assert b'"AVAILABLE"' in response.read()
    finally:
        server.stop()


def test_a_bad_ssl_config_file_stops_the_start(model_dirs: dict[str, Path], certs: dict[str, str],
                                               tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.integration.conftest import ROOT

    bad = tmp_path / "ssl.config"
    bad.write_text(f'server_key: "{certs["server_key"]}"\nserver_cert: "{certs["server_cert"]}"\n')
    done = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--rest-api-port", "-1",
                           "--model-base-path", str(model_dirs["echo"]), f"--ssl_config_file={bad}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert (f"--ssl_config_file {bad}: server_key must hold the PEM text itself (-----BEGIN ...), not a file name"
            in done.stderr), done.stderr[-2000:]


def test_under_mutual_tls_only_admin_certificates_may_manage_models(
        model_dirs: dict[str, Path], certs: dict[str, str], tmp_path: Path) -> None:
    """Inference clients hold certificates of --tls-client-ca-file too: only the certificates the
    admin token file names, or that --admin-client-ca-file issued, may change the served models;
    the others get PERMISSION_DENIED, logged with their names."""
    import grpc

    from protos.tensorflow_serving import model_management_pb2, model_service_pb2_grpc

    ca_key = serialization.load_pem_private_key(Path(certs["ca"]).with_suffix(".key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate(Path(certs["ca"]).read_bytes())
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    named = make_leaf(tmp_path / "ops-bot", "ops-bot", ca_key, ca_cert, server=False)
    admin_ca, admin_ca_key, admin_ca_cert = make_ca(tmp_path / "admin-ca", "admin CA")
    issued = make_leaf(tmp_path / "admin", "release-pipeline", admin_ca_key, admin_ca_cert, server=False)
    tokens = tmp_path / "admins"
    tokens.write_text("# admins\nclient-certificate ops-bot\n")
    server = start_server(["--model-base-path", str(model_dirs["echo"]), "--model-name", "echo",
                           "--tls-cert-file", certs["server_cert"], "--tls-key-file", certs["server_key"],
                           "--tls-client-ca-file", certs["ca"], "--enable-model-management",
                           "--admin-token-file", str(tokens), "--admin-client-ca-file", admin_ca,
                           "--drain-delay-s", "0"], tmp_path / "server.log")
    reload = model_management_pb2.ReloadConfigRequest()
    config = reload.config.model_config_list.config.add()
    config.name, config.base_path, config.model_platform = "echo", str(model_dirs["echo"]), "tensorflow"

    def reload_as(cert_and_key: tuple[str, str]) -> str:
        credentials = grpc.ssl_channel_credentials(
            Path(certs["ca"]).read_bytes(), Path(cert_and_key[1]).read_bytes(), Path(cert_and_key[0]).read_bytes())
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            try:
                model_service_pb2_grpc.ModelServiceStub(channel).HandleReloadConfigRequest(reload, timeout=30)
                return "OK"
            except grpc.RpcError as failed:
                return failed.code().name

    try:
        inference = (certs["client_cert"], certs["client_key"])
        results = {"inference client": reload_as(inference), "named in the token file": reload_as(named),
                   "issued by the admin CA": reload_as(issued)}
        assert results == {"inference client": "PERMISSION_DENIED", "named in the token file": "OK",
                           "issued by the admin CA": "OK"}, results
        admin_tls = Tls(ca_file=certs["ca"], cert_file=issued[0], key_file=issued[1])
        assert outcome(f"localhost:{server.port}", admin_tls) == "OK"  # the admin CA's certificates connect
        # v2 REST checks the same way, before anything else (a load of an unknown model)
        context = ssl.create_default_context(cafile=certs["ca"])
        context.load_cert_chain(*inference)
        load = urllib.request.Request(f"https://localhost:{server.rest_port}/v2/repository/models/nope/load",
                                      data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(load, timeout=10, context=context)
        assert refused.value.code == 403
        log = server.log()
        assert "by certificate good client: denied: not an admin certificate" in log
        assert "by certificate ops-bot: OK" in log and "by certificate release-pipeline: OK" in log
    finally:
        server.stop()
