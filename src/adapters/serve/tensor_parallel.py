"""`statecore run --tensor-parallel N`: one prefill, decode or single instance as N processes.

Every rank runs the same command line. Started by hand (no `MLX_RANK` in the environment), the
process becomes rank 0 and starts ranks 1..N-1 on this machine over MLX's ring backend on
127.0.0.1 (`adapters.mlx.distributed.start_local_ranks`), or, with `--hostfile`, hands the
whole command to `mlx.launch --hostfile --backend` (it starts every rank, this one included, on
the listed hosts). Under MLX's launch environment a process joins the group as the rank it is
given. Rank 0 is the node (HTTP front end, scheduler, engine); the others load their shard and
follow rank 0's plans (`adapters.mlx.distributed.LockstepLoop`) until it stops them, it goes
silent for `--stall-timeout`, or the group breaks: then they exit 3, and so does rank 0 when a
rank is lost (its engine dies or stalls: /health 503, its requests fail), for a supervisor to
restart the instance. `--pipeline-parallel N` starts the same N ranks, each holding a share of
the layers instead of the heads (`adapters.mlx.distributed`'s paragraph); a model family that
mlx-lm cannot pipeline is refused before any rank starts (exit 2), as is asking for both modes.
mlx is imported only after the BLAS choice (adapters.serve.command).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from adapters.mlx.distributed import TensorGroup

__all__ = ["heartbeat_s", "mlx_launch_argv", "run_tensor_parallel"]

log = logging.getLogger("statecore.serve")

_LAUNCH_ONLY_FLAGS = ("--hostfile",)


def heartbeat_s(stall_timeout_s: float) -> float:
    """How often an idle rank 0 broadcasts an empty plan: well inside the stall timeout."""
    return 1.0 if stall_timeout_s <= 0 else min(1.0, stall_timeout_s / 4)


def run_tensor_parallel(args: argparse.Namespace, role: str) -> int:
    from adapters.mlx.distributed import RANK_ENV, exited_rank, join_group, start_local_ranks
    from adapters.serve.listeners import listener_for
    from adapters.serve.node import hold_stop_signals, run_engine_node

    pipeline = args.pipeline_parallel > 1
    if pipeline and args.tensor_parallel > 1:
        print("statecore: --tensor-parallel and --pipeline-parallel cannot be combined: an instance "
              "shards its model by heads or by layers, not both", file=sys.stderr)
        return 2
    size = args.pipeline_parallel if pipeline else args.tensor_parallel
    if pipeline and (refusal := _pipeline_refusal(args)) is not None:
        print(f"statecore: {refusal}", file=sys.stderr)
        return 2
    children: list[subprocess.Popen[bytes]] = []
    if RANK_ENV not in os.environ:
        if args.hostfile is not None:
            return _hand_to_mlx_launch(args)
        listener = listener_for(args)  # bound before the ranks start: a port in use fails fast
        children = start_local_ranks(size, ["-m", "adapters.cli", *sys.argv[1:]])
    elif os.environ[RANK_ENV] == "0":
        listener = listener_for(args)
    else:
        joined = join_group(args.distributed_backend, size, heartbeat_s(args.stall_timeout))
        return _follow(args, role, dataclasses.replace(joined, pipeline=pipeline))
    hold_stop_signals()
    code = 1
    try:
        joined = join_group(args.distributed_backend, size, heartbeat_s(args.stall_timeout),
                            partial(exited_rank, children))
        tensor = dataclasses.replace(joined, pipeline=pipeline)
        log.info("rank 0 of a %s instance of %d ranks (%s parallel, %s backend)", role, size,
                 "pipeline" if pipeline else "tensor", args.distributed_backend)
        code = trio.run(run_engine_node, args, role, listener, tensor)
        return code
    finally:
        _reap(children, lost=code != 0)


def _pipeline_refusal(args: argparse.Namespace) -> str | None:
    """Why the model cannot run as a pipeline (its config.json's model type), before any rank
    starts; None when it can, or when the config cannot be read (the load says why)."""
    from adapters.mlx.loading import pipeline_refusal
    from adapters.serve.flags import demo_model_dir

    model = Path(args.model or demo_model_dir())
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return pipeline_refusal(model_type, args.pipeline_parallel)


def _follow(args: argparse.Namespace, role: str, tensor: TensorGroup) -> int:
    from adapters.heap import freeze_startup_heap
    from adapters.mlx import MlxEngine
    from adapters.mlx.distributed import PARENT_ENV, watch_follower
    from adapters.serve.flags import demo_model_dir
    from adapters.serve.logs import setup_logging
    from adapters.serve.node import engine_options

    setup_logging(args, f"{role}[{tensor.rank}]")  # its lines beside rank 0's in one stream
    # Ctrl-C reaches the whole process group: rank 0 drains and stops the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.environ.get(PARENT_ENV)
    model = args.model or demo_model_dir()
    engine = trio.run(partial(MlxEngine.load, model, **engine_options(args, role), tensor=tensor))
    freeze_startup_heap()  # a full collection would stall its device thread, and so every rank's step
    code = watch_follower(engine.follower_loop, engine.device_thread, args.stall_timeout,
                          int(parent) if parent and parent.isdigit() else None)
    log.log(logging.INFO if code == 0 else logging.ERROR, "rank %d exiting %d", tensor.rank, code)
    return code


def mlx_launch_argv(argv: Sequence[str], *, launcher: str, python: str, backend: str,
                    hostfile: str) -> list[str]:
    """`mlx.launch`'s command line for this `statecore` command line (`argv` without the program):
    the same command on every host, without --hostfile, after `--` (so that none of its flags is
    read as one of mlx.launch's: `--host` would abbreviate its `--hosts`)."""
    command, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in _LAUNCH_ONLY_FLAGS:
            skip = True
            continue
        if word.startswith(tuple(f"{flag}=" for flag in _LAUNCH_ONLY_FLAGS)):
            continue
        command.append(word)
    return [launcher, "--backend", backend, "--hostfile", hostfile, "--",
            python, "-m", "adapters.cli", *command]


def _hand_to_mlx_launch(args: argparse.Namespace) -> int:
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    argv = mlx_launch_argv(sys.argv[1:], launcher=launcher, python=sys.executable,
                           backend=args.distributed_backend, hostfile=args.hostfile)
    log.info("starting the ranks through %s", " ".join(argv))
    os.execv(launcher, argv)
    return 1  # not reached


def _reap(children: list[subprocess.Popen[bytes]], *, lost: bool) -> None:
    """Rank 0 is leaving: the other ranks left with it (a Stop plan); after a loss they go now
    (SIGKILL: a stalled rank may be stopped or stuck inside a collective)."""
    for child in children:
        if lost and child.poll() is None:
            child.kill()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("rank pid %d did not exit; killing it", child.pid)
            child.kill()
