"""TLS on every node: the files a node serves HTTPS with, and the one way a node verifies its peers.

`--tls-certfile` and `--tls-keyfile` make a node serve HTTPS (hypercorn's certfile/keyfile);
`--tls-ca-file` is the CA bundle a node checks its https:// peers' certificates against (the
router's calls to prefill and decode nodes, a decode node's KV pull, a local cluster's health
waits), else the system's store. `tls_files` checks all three when the node starts (both or
neither of certificate and key; every file readable and of the right kind), so that a mistake is
one line before anything loads, not a traceback once the model is up. `client_context` is the one
place a client-side `ssl.SSLContext` is made: certificates and host names are always verified,
and nothing here can turn that off; `certificate_refused` tells a refused certificate from other
connection failures, so callers can say so instead of waiting on a peer that can never answer.
Plain http:// peers stay plain: the scheme of each peer's URL decides. This is an adapter on the
standard library alone; nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


class TlsConfigError(ValueError):
    """The TLS flags cannot work as given; the message is one line naming the flag."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """What `--tls-certfile`, `--tls-keyfile` and `--tls-ca-file` named, once checked."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_file: str | None = None

    @property
    def serves_https(self) -> bool:
        return self.certfile is not None and self.keyfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.serves_https else "http"


def _readable(flag: str, path: str) -> None:
    try:
        with Path(path).open("rb") as file:
            file.read(1)
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None


def _refuse_prompt() -> bytes:
    # Without a callback OpenSSL would ask for an encrypted key's pass phrase on the terminal.
    raise TlsConfigError("encrypted")


def tls_files(certfile: str | None, keyfile: str | None, ca_file: str | None) -> TlsFiles:
    """The checked TLS files; raises TlsConfigError with one line when they cannot work."""
    if (certfile is None) != (keyfile is None):
        given, missing = ("--tls-certfile", "--tls-keyfile") if keyfile is None else (
            "--tls-keyfile", "--tls-certfile")
        raise TlsConfigError(f"{given} needs {missing}: give both (to serve HTTPS) or neither")
    for flag, path in (("--tls-certfile", certfile), ("--tls-keyfile", keyfile), ("--tls-ca-file", ca_file)):
        if path is not None:
            _readable(flag, path)
    if certfile is not None and keyfile is not None:
        try:
            server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server.load_cert_chain(certfile, keyfile, password=_refuse_prompt)
        except (ssl.SSLError, TlsConfigError) as exc:
            why = ("the key is encrypted (give an unencrypted key, readable by this user only)"
                   if isinstance(exc, TlsConfigError) else
                   "not a PEM certificate (chain) and the private key that goes with it")
            raise TlsConfigError(f"--tls-certfile {certfile} / --tls-keyfile {keyfile}: {why}") from None
    if ca_file is not None:
        try:
            client_context(ca_file)
        except ssl.SSLError:
            raise TlsConfigError(f"--tls-ca-file {ca_file}: holds no PEM CA certificate") from None
    return TlsFiles(certfile, keyfile, ca_file)


def client_context(ca_file: str | None) -> ssl.SSLContext:
    """The context a node connects to https:// peers with: their certificate must chain to
    `ca_file` (only to it: the system store is not added) or, without one, to the system store,
    and name the host in the URL."""
    context = ssl.create_default_context(cafile=ca_file)
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    return context


def certificate_refused(exc: BaseException) -> str | None:
    """Why a peer's TLS certificate failed verification, when that is what `exc` (an httpx error,
    a StatecoreError, or what they were raised from) comes down to; None otherwise."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return str(cause.verify_message or cause.reason or cause)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


__all__ = ["TlsConfigError", "TlsFiles", "certificate_refused", "client_context", "tls_files"]
