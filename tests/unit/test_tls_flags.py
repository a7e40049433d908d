"""The TLS flags as an operator meets them: on every role, a certificate without its key (or a key
without its certificate), a file that cannot be read or is not what its flag says is refused in
one line before anything loads; good files make hypercorn serve HTTPS, name the node https://,
reach a local cluster's children, and give peers a context that always verifies."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme

from adapters.cli import build_parser, main
from adapters.serve.cluster import forwarded_serving_flags
from adapters.serve.listeners import listener_url, open_listener
from adapters.serve.node import hypercorn_config
from adapters.tls import TlsConfigError, TlsFiles, client_context, tls_files

ROLES = ["cluster", "single", "prefill", "decode", "router"]


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, str]:
    """A throwaway CA and a certificate for 127.0.0.1 it signed, as PEM files."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key", "junk")}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    paths["junk"].write_text("not a certificate\n")
    return {name: str(path) for name, path in paths.items()}


def refusal(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """What `statecore run ...` says when it refuses to start (it must, before anything loads)."""

    def went_on(args: object) -> None:
        raise AssertionError(f"statecore run {' '.join(argv)} went on to resolve the model")

    monkeypatch.setattr("adapters.serve.command.resolve_model_flag", went_on)
    with pytest.raises(SystemExit) as stopped:
        main(["run", *argv])
    said = str(stopped.value.code)
    assert said.startswith("statecore: ") and len(said.splitlines()) == 1, said
    return said


@pytest.mark.parametrize("role", ROLES)
def test_a_certificate_without_its_key_is_refused_on_every_role(role: str, pems: dict[str, str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    router = ["--prefill", "https://127.0.0.1:1", "--decode", "https://127.0.0.1:2"]
    router = router if role == "router" else []
    said = refusal(["--role", role, *router, "--tls-certfile", pems["cert"]], monkeypatch)
    assert "--tls-certfile needs --tls-keyfile" in said, said
    said = refusal(["--role", role, *router, "--tls-keyfile", pems["key"]], monkeypatch)
    assert "--tls-keyfile needs --tls-certfile" in said, said


NOT_A_PAIR = "not a PEM certificate (chain) and the private key"


@pytest.mark.parametrize(("flags", "expected"), [
    (["--tls-certfile", "{tmp}/missing.pem", "--tls-keyfile", "{key}"],
     "--tls-certfile {tmp}/missing.pem: cannot read it (No such file or directory)"),
    (["--tls-certfile", "{cert}", "--tls-keyfile", "{tmp}"],
     "--tls-keyfile {tmp}: cannot read it (Is a directory)"),
    (["--tls-ca-file", "{tmp}/nothing.pem"], "--tls-ca-file {tmp}/nothing.pem: cannot read it"),
    (["--tls-certfile", "{junk}", "--tls-keyfile", "{key}"], NOT_A_PAIR),
    (["--tls-certfile", "{cert}", "--tls-keyfile", "{ca}"], NOT_A_PAIR),
    (["--tls-ca-file", "{key}"], "--tls-ca-file {key}: holds no PEM CA certificate"),
])
def test_unreadable_or_wrong_files_are_refused_naming_the_flag(
        flags: list[str], expected: str, pems: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    names = {**pems, "tmp": str(tmp_path)}
    said = refusal(["--role", "single", *(f.format(**names) for f in flags)], monkeypatch)
    assert expected.format(**names) in said, said


def test_an_encrypted_key_is_refused_without_asking_for_a_pass_phrase(pems: dict[str, str],
                                                                      tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(pems["key"]).read_bytes(), None)
    locked = tmp_path / "locked.pem"
    locked.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.BestAvailableEncryption(b"pass phrase")))
    with pytest.raises(TlsConfigError, match="the key is encrypted"):
        tls_files(pems["cert"], str(locked), None)


def test_good_files_serve_https_and_name_the_node_https(pems: dict[str, str]) -> None:
    tls = tls_files(pems["cert"], pems["key"], pems["ca"])
    assert tls.serves_https and tls.scheme == "https"
    assert not tls_files(None, None, pems["ca"]).serves_https  # a CA alone: plain server, https peers
    assert TlsFiles().scheme == "http"
    with open_listener("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert listener_url(sock, https=True) == f"https://127.0.0.1:{port}"
        assert listener_url(sock) == f"http://127.0.0.1:{port}"
        config = hypercorn_config(sock, tls)
    assert config.ssl_enabled and (config.certfile, config.keyfile) == (pems["cert"], pems["key"])
    with open_listener("127.0.0.1", 0) as sock:
        assert not hypercorn_config(sock, TlsFiles(ca_file=pems["ca"])).ssl_enabled


def test_a_local_cluster_hands_the_tls_flags_to_its_children(pems: dict[str, str]) -> None:
    flags = ["--tls-certfile", pems["cert"], "--tls-keyfile", pems["key"], "--tls-ca-file", pems["ca"]]
    forwarded = forwarded_serving_flags(build_parser().parse_args(["run", *flags]))
    assert forwarded == flags
    child = build_parser().parse_args(["run", "--role", "decode", *forwarded])
    given = (child.tls_certfile, child.tls_keyfile, child.tls_ca_file)
    assert given == (pems["cert"], pems["key"], pems["ca"])


def test_peers_always_verify_against_the_given_ca_only(pems: dict[str, str]) -> None:
    given = client_context(pems["ca"])
    assert given.verify_mode is ssl.CERT_REQUIRED and given.check_hostname
    assert len(given.get_ca_certs()) == 1  # the CA file replaces the system store, it is not added
    system = client_context(None)
    assert system.verify_mode is ssl.CERT_REQUIRED and system.check_hostname
