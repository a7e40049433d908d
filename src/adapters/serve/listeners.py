"""The sockets nodes serve on. Every node binds its port before it loads anything (a port in use
fails at once, with one line); a parent that starts nodes binds their sockets itself and hands them
down (`--listen-fd`), so no other process can take a port between the choice and the child's bind.
This module may import anything.
"""

from __future__ import annotations

import argparse
import errno
import socket

LISTEN_BACKLOG = 1024


def open_listener(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket on host:port (0: any free port). A child started with
    `pass_fds=(sock.fileno(),)` inherits it (and only it) and can serve on it (`--listen-fd`).
    Raises OSError (port in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may find TIME_WAIT
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def listener_url(sock: socket.socket, *, https: bool = False) -> str:
    host, port = sock.getsockname()[:2]
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def listener_for(args: argparse.Namespace) -> socket.socket:
    """The socket this node serves on: the inherited one, or --host:--port bound now, before
    anything slow, so that a port in use is one clear line instead of a traceback after loading."""
    if args.listen_fd is not None:
        try:
            sock = socket.socket(fileno=args.listen_fd)
            sock.getsockname()
        except OSError as exc:
            raise SystemExit(f"statecore: --listen-fd {args.listen_fd} is not an open socket: "
                             f"{exc.strerror}") from exc
        if sock.type != socket.SOCK_STREAM:
            raise SystemExit(f"statecore: --listen-fd {args.listen_fd} is not a TCP socket")
        return sock
    return bind_or_exit(args.host, args.port, "--port")


def bind_or_exit(host: str, port: int, flag: str) -> socket.socket:
    """`open_listener`, or one line saying why not and what to do (SystemExit)."""
    try:
        return open_listener(host, port)
    except OSError as exc:
        hint = (f"another process holds it: stop that one, or choose another port with {flag}"
                if exc.errno == errno.EADDRINUSE else
                f"check the address and {flag}" if exc.errno != errno.EACCES else
                f"ports below 1024 need privileges: choose another with {flag}")
        raise SystemExit(f"statecore: cannot listen on {host}:{port}: {exc.strerror} ({hint})") from None


def free_port() -> int:
    """A port that was free a moment ago, for servers that cannot take an inherited socket
    (mlx_lm.server in the benchmarks); another process may take it before they bind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
