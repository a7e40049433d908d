"""`statecore run` with no role: router + prefill + decode as child processes on 127.0.0.1,
stopped cleanly on Ctrl-C or SIGTERM. The parent binds the children's sockets, hands them the
serving flags it was given (secrets through the environment), waits on their health (over https
with the TLS flags) and prints the start-up banner. This module may import anything.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

from adapters.blas import apply_blas_choice
from adapters.http.api_keys import API_KEY_ENV, ApiKeys
from adapters.http.internal_wire import TOKEN_HEADER
from adapters.serve.flag_roles import roles_reading
from adapters.serve.flags import INTERNAL_TOKEN_ENV, add_serving_flags, demo_model_dir, handoff_rule
from adapters.serve.listeners import bind_or_exit, listener_for, listener_url
from adapters.serve.node import LOCAL_CLUSTER_PARENT_ENV, blas_words
from adapters.tls import TlsFiles, certificate_refused, client_context


def wait_healthy(url: str, child: subprocess.Popen[bytes], timeout_s: float,
                 headers: Mapping[str, str] | None = None, *, verify: ssl.SSLContext | None = None,
                 stop: Callable[[], bool] | None = None) -> str | None:
    """Poll a starting node's /health until it answers 200. None when it does; otherwise why
    not (the process exited, the time ran out, its TLS certificate was refused: waiting cannot
    mend that, or `stop()` turned true), for the caller to raise as it sees fit.
    `headers`: an API key, where `--api-key-protects health` closes /health. `verify`: what an
    https:// node's certificate must chain to (default: the system store)."""
    deadline = time.monotonic() + timeout_s
    context = verify if verify is not None else client_context(None)
    with httpx.Client(verify=context, timeout=1.0, headers=headers) as client:
        while time.monotonic() < deadline:
            if stop is not None and stop():
                return f"stopped waiting for {url}"
            if child.poll() is not None:
                return f"{url} exited with code {child.returncode} while starting"
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return None
            except httpx.HTTPError as exc:
                refused = certificate_refused(exc)
                if refused is not None:
                    return (f"{url}: its TLS certificate does not verify ({refused}); give the CA that "
                            "signed it with --tls-ca-file, and a certificate for that host name or IP")
            time.sleep(0.1)
    return f"{url} was not healthy within {timeout_s:.0f} s"


# Per child (its own socket) or passed another way (the secrets: through the environment).
_NOT_FORWARDED = frozenset({"listen_fd", "internal_token", "api_key"})


def forwarded_serving_flags(args: argparse.Namespace, role: str | None = None) -> list[str]:
    """Every serving flag (`add_serving_flags`) set to other than its default, as arguments
    for a local cluster's children: what the user asked of the cluster reaches its nodes; with
    `role`, only the flags that role reads (`roles_reading`: a node warns of any other)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_serving_flags(probe)
    readers = roles_reading(probe)
    flags: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in _NOT_FORWARDED or value == action.default:
            continue
        if role is not None and role not in readers[action.dest]:
            continue
        option = action.option_strings[0]
        if isinstance(value, bool):
            flags.append(option)
        elif isinstance(value, list):
            flags += [item for entry in value for item in (option, str(entry))]
        else:
            flags += [option, str(value)]
    return flags


def shared_device_flags(args: argparse.Namespace, gpus: tuple[str, str] | None) -> list[str]:
    """Both engine nodes of a local cluster on this machine's one device (no `gpus` of their own):
    each takes half of a default KV budget, unless the user said how many share it (then it is
    forwarded as given)."""
    return ["--device-shared-by", "2"] if args.device_shared_by == 1 and gpus is None else []


def engine_gpus(env: Mapping[str, str], cuda_backend: bool) -> tuple[str, str] | None:
    """A GPU each for the prefill and the decode node (as CUDA names them), when MLX computes on
    CUDA here and two or more are visible: the first two of CUDA_VISIBLE_DEVICES when it is set,
    else of what `nvidia-smi` lists. Disaggregation is for separate devices: two nodes on one GPU
    share its compute and memory. None: one device for both (one GPU, Apple silicon, the CPU)."""
    if not cuda_backend:
        return None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [gpu.strip() for gpu in visible.split(",") if gpu.strip()]
    else:
        smi = shutil.which("nvidia-smi", path=env.get("PATH"))
        if smi is None:
            return None
        try:
            listed = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=20, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        ids = listed.stdout.split() if listed.returncode == 0 else []
    return (ids[0], ids[1]) if len(ids) >= 2 else None


def mlx_computes_on_cuda() -> bool:
    """Whether the installed MLX is its CUDA build (the `mlx-cuda-*` distribution), asked of the
    package metadata: importing MLX here would open a CUDA context in this parent process."""
    return any((dist.metadata["Name"] or "").lower().replace("_", "-").startswith("mlx-cuda")
               for dist in importlib.metadata.distributions())


HANDOFF_PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived an "
                  "old king with three daughters. One winter the king fell ill, and a wise woman "
                  "told him that only water from the well at the end of the world could heal him. "
                  "Tell me what happened to each daughter on the road.")
"""The prompt the start-up banner (and the README) suggests: long enough for the demo model's
router to send it through the prefill node."""


def _router_threshold(router: str, token: str | None, verify: ssl.SSLContext) -> int | None:
    """The running router's local-prefill threshold (its /internal/stats), for the banner."""
    headers = {TOKEN_HEADER: token} if token else {}
    try:
        value = httpx.get(f"{router}/internal/stats", headers=headers, timeout=5.0, verify=verify).json()
        threshold = value.get("local_prefill_below")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return threshold if isinstance(threshold, int) else None


def _banner(router: str, urls: dict[str, str], model: str, threshold: int | None, blas: str,
            keyed: bool = False, cacert: str | None = None) -> str:
    body = json.dumps({"model": model, "max_tokens": 64,
                       "messages": [{"role": "user", "content": HANDOFF_PROMPT}]})
    key = "-H 'Authorization: Bearer <your API key>' " if keyed else ""
    key += f"--cacert {cacert} " if cacert and router.startswith("https://") else ""
    rule = "" if threshold is None else f"Routing: {handoff_rule(threshold)}.\n"
    rule += f"MLX computes with {blas_words(blas)}.\n"
    return (f"\nstatecore cluster ready: router {router}  (prefill {urls['prefill']}, "
            f"decode {urls['decode']})\n{rule}\nTry (a prompt long enough to go through the "
            f"prefill node):\n  curl -s {router}/v1/chat/completions "
            f"-H 'Content-Type: application/json' {key}\\\n    -d '{body}'\n\nCtrl-C stops every node.")


def run_cluster(args: argparse.Namespace) -> int:
    """router + prefill + decode as children (the engine nodes on --prefill-port and --decode-port,
    free ports by default); Ctrl-C or SIGTERM stops them all.

    The children run in their own process group, so a terminal's Ctrl-C (SIGINT to the whole
    foreground group) reaches only this parent, which then stops each child with exactly one
    SIGTERM: a child that got both signals used to be killed by the second one mid-drain. A child
    whose parent disappears drains by itself (LOCAL_CLUSTER_PARENT_ENV)."""
    model = str(getattr(args, "model_given", None) or args.model or demo_model_dir())
    # The parent resolves --blas once and hands the result to both engine nodes, so they cannot
    # end up on different BLAS (it also fails here, once, when OpenBLAS is asked for but missing).
    blas = apply_blas_choice(args.blas, may_reexec=False)
    engine_flags = ["--model", model]
    gpus = engine_gpus(os.environ, mlx_computes_on_cuda())
    engine_flags += shared_device_flags(args, gpus)
    if blas in ("openblas", "bundled"):
        engine_flags += ["--blas", blas]
    if args.trust_remote_code:
        engine_flags.append("--trust-remote-code")
    # the shared secret reaches the children through their environment, not their command lines
    child_env = {**os.environ, LOCAL_CLUSTER_PARENT_ENV: str(os.getpid())}
    if args.internal_token:
        child_env[INTERNAL_TOKEN_ENV] = args.internal_token
    keys: ApiKeys | None = args.api_keys
    if keys is not None:
        child_env[API_KEY_ENV] = ",".join(keys.keys)  # the router's (the engine nodes ignore it)
    router_health = ({"Authorization": f"Bearer {keys.keys[0]}"}
                     if keys is not None and "health" in keys.protects else None)
    sockets = {"router": listener_for(args)}
    try:
        sockets["prefill"] = bind_or_exit("127.0.0.1", args.prefill_port, "--prefill-port")
        sockets["decode"] = bind_or_exit("127.0.0.1", args.decode_port, "--decode-port")
    except SystemExit:
        for sock in sockets.values():
            sock.close()
        raise
    tls: TlsFiles = args.tls  # the children get the TLS flags with the others (`forwarded`)
    urls = {role: listener_url(sock, https=tls.serves_https) for role, sock in sockets.items()}
    # this process's own calls reach a router bound to every address on loopback
    local = {role: url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//[::1]:")
             for role, url in urls.items()}
    verify = client_context(tls.ca_file)
    base = [sys.executable, "-m", "adapters.cli", "run"]
    children: dict[str, subprocess.Popen[bytes]] = {}
    received: list[int] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signum)

    def start(role: str, flags: list[str]) -> None:
        sock = sockets[role]
        env = child_env
        if gpus is not None and role != "router":
            env = {**child_env, "CUDA_VISIBLE_DEVICES": gpus[0] if role == "prefill" else gpus[1]}
        children[role] = subprocess.Popen([*base, "--role", role, "--listen-fd", str(sock.fileno()), *flags],
                                          pass_fds=(sock.fileno(),), env=env, process_group=0)
        sock.close()  # the child holds it now

    def wait_healthy_or_stop(role: str, timeout_s: float) -> bool:
        """True once the child is healthy; False when a stop signal came first."""
        problem = wait_healthy(local[role], children[role], timeout_s,
                               router_health if role == "router" else None, verify=verify,
                               stop=lambda: bool(received))
        if received:
            return False
        if problem is not None:
            raise SystemExit(f"statecore: the {role} node did not start: {problem}")
        return True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    exited: str | None = None
    try:
        for role in ("prefill", "decode"):
            start(role, [*engine_flags, *forwarded_serving_flags(args, role)])
        placement = "" if gpus is None else f" (prefill on GPU {gpus[0]}, decode on GPU {gpus[1]})"
        print(f"statecore: starting prefill and decode nodes{placement} ...", flush=True)
        if all(wait_healthy_or_stop(role, 600) for role in ("prefill", "decode")):
            start("router", ["--model", model, "--prefill", urls["prefill"], "--decode", urls["decode"],
                             *forwarded_serving_flags(args, "router")])
            if wait_healthy_or_stop("router", 120):
                threshold = _router_threshold(local["router"], args.internal_token, verify)
                served = getattr(args, "served_model_name", None) or Path(model).name
                print(_banner(urls["router"], urls, served, threshold, blas, keys is not None, tls.ca_file),
                      flush=True)
        while not received and exited is None:
            for role, child in children.items():
                if child.poll() is not None:
                    exited = f"the {role} node exited with {child.returncode}"
            time.sleep(0.2)
    finally:
        for sock in sockets.values():
            sock.close()  # those not handed to a child yet (no-op for the others)
        # the router first: it stops logging its peers' health before they start draining
        for role in sorted(children, key=lambda r: r != "router"):
            if children[role].poll() is None:
                children[role].send_signal(signal.SIGTERM)
        for child in children.values():
            try:
                child.wait(timeout=args.drain_timeout + 5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    why = exited or f"stopped on {signal.Signals(received[0]).name}"
    failed = {role: child.returncode for role, child in children.items() if child.returncode != 0}
    if failed or exited:
        print(f"statecore: {why}; nodes exited uncleanly: {failed}" if failed else
              f"statecore: {why}; the others stopped cleanly", flush=True)
        return 1
    print(f"statecore: {why}: every node drained and stopped cleanly", flush=True)
    return 0
