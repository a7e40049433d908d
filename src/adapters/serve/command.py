"""`statecore run`: resolve the flags, then start the role asked for: a local cluster, the
router, or an engine node (one process, or a tensor-parallel instance). This module may import
anything.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import trio

from adapters.blas import apply_blas_choice
from adapters.serve.cluster import run_cluster
from adapters.serve.flag_roles import role_words
from adapters.serve.flags import resolve_api_keys, resolve_engine_core, resolve_model_flag, resolve_tls
from adapters.serve.listeners import listener_for
from adapters.serve.logs import setup_logging
from adapters.serve.node import hold_stop_signals, run_engine_node, run_router

log = logging.getLogger("statecore")


def run_command(args: argparse.Namespace) -> int:
    """Start the role asked for. A person's mistake at start-up (a bad path, a directory that is
    not a model, a port in use, a setting that cannot work) ends it with one line that names the
    role and what to do, never a traceback."""
    try:
        return _run_role(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            raise SystemExit(said_by_role(exc.code, args.role)) from None
        raise


def said_by_role(line: str, role: str) -> str:
    """`statecore: X` as `statecore: the role: X` (a local cluster's nodes share one terminal)."""
    prefix = "statecore: "
    text = line[len(prefix):] if line.startswith(prefix) else line
    return f"{prefix}{role_words(role)}: {text}"


def _run_role(args: argparse.Namespace) -> int:
    role = args.role
    setup_logging(args, role)
    for line in getattr(args, "other_role_flags", []):
        log.warning("%s", line)
    resolve_tls(args)
    resolve_model_flag(args)
    resolve_api_keys(args)
    if role == "cluster":
        return run_cluster(args)
    if role == "router":
        hold_stop_signals()
        return trio.run(run_router, args, listener_for(args))
    # may re-execute this process with the system OpenBLAS preloaded; the nodes sharing this
    # device (a local cluster's two) share its cores among their OpenBLAS threads
    apply_blas_choice(args.blas, engine_nodes=getattr(args, "device_shared_by", 1))
    resolve_engine_core(args)
    if args.tensor_parallel > 1 or args.pipeline_parallel > 1:
        if args.engine_core == "process":
            raise SystemExit("statecore: --engine-core process does not serve a tensor- or pipeline-parallel "
                             "instance (its ranks run in lockstep on their device threads): drop one")
        from adapters.serve.tensor_parallel import run_tensor_parallel

        return _exit_now(run_tensor_parallel(args, role))
    hold_stop_signals()
    return _exit_now(trio.run(run_engine_node, args, role, listener_for(args)))


def _exit_now(code: int) -> int:
    """End an engine node without interpreter teardown. Everything is already closed (the loop
    drained or stopped, the device thread joined); what is left is MLX's C++ static teardown,
    which was seen to abort ("terminate called without an active exception") in a few percent
    of short-lived MLX processes under load, turning a clean exit 0 into -6."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
