"""Which BLAS MLX's CPU matmuls run on, and putting the system OpenBLAS under them at start.

MLX's Linux CPU wheel links `cblas_sgemm` from a vendored reference (netlib) BLAS; a system
OpenBLAS preloaded with `LD_PRELOAD` interposes it and makes prefill ~3-11x faster. The dynamic
linker reads `LD_PRELOAD` only when a process starts, so `apply_blas_choice` re-executes the
process (same pid, same command line) with it set, before mlx is imported. The two BLAS differ in
the last bits of float32 results, so every node of a cluster must use the same one: `blas_in_use`
names it for /internal/info and for the engine's model fingerprint. OpenBLAS's threads
(`blas_thread_env`): a node computes on its share of the cores of its affinity mask (a local
cluster's two engine nodes share the box's), and an idle OpenBLAS
worker sleeps at once instead of spinning ~0.1 s after each call (the environment's own settings
win). One thread and several round large matmuls differently, so the fingerprint says which
(`blas_in_use`). Everything but `blas_in_use`
is plain stdlib and must never import mlx (it runs before mlx loads, and in the router, which
only needs a tokenizer); `blas_in_use` imports mlx lazily.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn, assert_never

log = logging.getLogger("statecore")

BlasChoice = Literal["auto", "openblas", "bundled"]
BLAS_CHOICES: tuple[BlasChoice, ...] = ("auto", "openblas", "bundled")
CHOICE_ENV = "STATECORE_BLAS"
# Holds the pid of a process that already re-executed itself for its BLAS. exec keeps the pid,
# so a re-executed process recognises itself, while children that inherit the variable do not.
REEXEC_MARKER_ENV = "STATECORE_BLAS_REEXEC_PID"
INSTALL_HINT = "apt-get install libopenblas0"

_LDCONFIG_ARCH_TAG = {"x86_64": "x86-64", "aarch64": "AArch64"}


def parse_blas_choice(text: str) -> BlasChoice:
    """`auto`, `openblas` or `bundled` (any case, surrounding spaces ignored); ValueError otherwise."""
    value = text.strip().lower()
    for choice in BLAS_CHOICES:
        if value == choice:
            return choice
    raise ValueError(f"BLAS choice must be one of {', '.join(BLAS_CHOICES)}, not {text!r}")


def default_blas_choice(environ: Mapping[str, str] = os.environ) -> str:
    """The `--blas` default: $STATECORE_BLAS, else `auto` (argparse validates it with the flag's type)."""
    return environ.get(CHOICE_ENV) or "auto"


def openblas_candidates(machine: str | None = None) -> list[Path]:
    """Where distributions put the OpenBLAS shared library, most common first."""
    arch = machine or platform.machine()
    return [
        Path(f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0"),  # Debian, Ubuntu: libopenblas0
        Path("/usr/lib64/libopenblasp.so.0"),  # Fedora, RHEL: openblas-threads
        Path("/usr/lib64/libopenblas.so.0"),  # Fedora, RHEL, openSUSE
        Path("/usr/lib/libopenblas.so.0"),  # Arch, Alpine
    ]


def openblas_from_ldconfig(listing: str, machine: str | None = None) -> Path | None:
    """The first OpenBLAS of this machine's architecture in `ldconfig -p` output."""
    tag = _LDCONFIG_ARCH_TAG.get(machine or platform.machine())
    for line in listing.splitlines():
        name, _, rest = line.strip().partition(" ")
        flags, _, target = rest.partition("=>")
        if not name.startswith("libopenblas") or not target.strip():
            continue
        if tag is not None and tag not in flags:  # a 32-bit or foreign library would fail to preload
            continue
        return Path(target.strip())
    return None


def _ldconfig_listing() -> str:
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if Path(p).exists()), None)
    if ldconfig is None:
        return ""
    try:
        return subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def find_openblas() -> Path | None:
    """The system OpenBLAS library, or None when none is installed (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    for path in openblas_candidates():
        if path.exists():
            return path
    found = openblas_from_ldconfig(_ldconfig_listing())
    return found if found is not None and found.exists() else None


def mapped_files(pid: int | str = "self") -> list[str]:
    """Paths of the files mapped into a process (Linux /proc/<pid>/maps); [] where unreadable."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {fields[5] for line in lines if len(fields := line.split(maxsplit=5)) == 6}
    return sorted(p for p in paths if p.startswith("/"))


def is_system_openblas(path: str) -> bool:
    """An OpenBLAS that can sit under MLX's matmuls. Python wheels vendor their own copies
    (numpy's `libscipy_openblas64_`); those are loaded privately with renamed symbols and never
    serve MLX, so anything inside a site-packages or dist-packages directory does not count."""
    parts = Path(path).parts
    if any(part in ("site-packages", "dist-packages") for part in parts):
        return False
    return any("openblas" in part.lower() for part in parts[-2:])  # libopenblas*.so*, openblas-*/libblas.so.3


def mapped_blas(pid: int | str = "self") -> list[str]:
    """The BLAS and LAPACK libraries mapped into a process: what bench and tests print."""
    return [p for p in mapped_files(pid) if any(k in Path(p).name.lower() for k in ("blas", "lapack"))]


def system_openblas_mapped(pid: int | str = "self") -> bool:
    return any(is_system_openblas(p) for p in mapped_files(pid))


def cpu_blas_applies() -> bool:
    """Whether MLX will do its matmuls through a CPU BLAS we can swap: Linux with a CPU-only MLX.
    A CUDA build computes on the GPU and macOS uses Accelerate, so there the choice is a no-op.
    Decided from the installed distributions, because importing mlx to ask is what we avoid."""
    if not sys.platform.startswith("linux"):
        return False
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    return not any(name.lower().replace("_", "-").startswith("mlx-cuda") for name in names)


@functools.cache
def blas_in_use() -> str:
    """What MLX's matmuls run on in this process: "openblas" (on several threads),
    "openblas-1thread", "bundled" (the reference BLAS of the Linux CPU wheel), "accelerate"
    (macOS CPU) or "gpu". Imports mlx. Fold it into the model fingerprint: results differ in the
    last bits between these (OpenBLAS on one thread and on several: a 700-token prompt's logits
    differ; two, three and four threads agree)."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        return "gpu"
    if sys.platform == "darwin":
        return "accelerate"
    if not system_openblas_mapped():
        return "bundled"
    return "openblas-1thread" if openblas_threads_now() == 1 else "openblas"


def openblas_threads_now() -> int | None:
    """The thread count of the OpenBLAS loaded in this process (None where none answers)."""
    import ctypes

    try:
        getter = ctypes.CDLL(None).openblas_get_num_threads
    except (AttributeError, OSError):
        return None
    getter.argtypes, getter.restype = [], ctypes.c_int
    count: int = getter()
    return count


# The decision before mlx loads: a pure function of what the process sees.


@dataclass(frozen=True, slots=True)
class KeepProcess:
    """Go on as is. `blas` is what MLX will use ("openblas", "bundled" or "n/a" off Linux CPU);
    `note` is a line to log (a fallback the user should know about)."""

    blas: str
    note: str | None = None
    kind: Literal["keep"] = "keep"


@dataclass(frozen=True, slots=True)
class ReexecProcess:
    """Start this command line again, with `LD_PRELOAD` set to `ld_preload` ("" removes it)."""

    blas: str
    ld_preload: str
    kind: Literal["reexec"] = "reexec"


@dataclass(frozen=True, slots=True)
class RefuseBlas:
    """The choice cannot be honoured here: exit with `message`."""

    message: str
    kind: Literal["refuse"] = "refuse"


BlasDecision = KeepProcess | ReexecProcess | RefuseBlas


def _preload_entries(ld_preload: str) -> list[str]:
    return ld_preload.replace(":", " ").split()  # ld.so accepts both separators


def decide_blas(
    choice: BlasChoice,
    *,
    applies: bool,
    openblas: Path | None,
    openblas_mapped: bool,
    reexecuted: bool,
    ld_preload: str,
    openblas_settled: bool = True,
) -> BlasDecision:
    """What to do about the BLAS at start. `openblas`: the system library found (None: none);
    `openblas_mapped`: a system OpenBLAS is already in the process (LD_PRELOAD at start);
    `reexecuted`: this process already re-executed itself once (never loop); `openblas_settled`:
    the environment already holds what OpenBLAS must load with (`blas_thread_env`), else a process
    that preloaded it starts again to load it with that."""
    if not applies:
        return KeepProcess("n/a")
    if choice == "bundled":
        if not openblas_mapped:
            return KeepProcess("bundled")
        if reexecuted:
            return RefuseBlas("--blas bundled: a system OpenBLAS is still loaded after removing it from "
                              f"LD_PRELOAD ({ld_preload!r}); something else loads it")
        kept = [e for e in _preload_entries(ld_preload) if not is_system_openblas(e)]
        return ReexecProcess("bundled", " ".join(kept))
    if openblas_mapped:
        if openblas_settled or reexecuted:
            return KeepProcess("openblas")
        return ReexecProcess("openblas", ld_preload)
    if openblas is None:
        if choice == "openblas":
            return RefuseBlas(f"--blas openblas: no system OpenBLAS found (install it: {INSTALL_HINT})")
        return KeepProcess("bundled", "no system OpenBLAS found: using MLX's bundled reference BLAS, "
                                      f"prefill is ~3-10x slower on CPU ({INSTALL_HINT} to fix)")
    if reexecuted:
        problem = f"preloading {openblas} did not load it"
        if choice == "openblas":
            return RefuseBlas(f"--blas openblas: {problem}")
        return KeepProcess("bundled", f"{problem}: using MLX's bundled reference BLAS")
    return ReexecProcess("openblas", " ".join([str(openblas), *_preload_entries(ld_preload)]))


def decide_blas_here(choice: BlasChoice, environ: Mapping[str, str] = os.environ,
                     openblas_settled: bool = True) -> BlasDecision:
    """`decide_blas` with this process's facts."""
    applies = cpu_blas_applies()
    return decide_blas(
        choice,
        applies=applies,
        openblas=find_openblas() if applies else None,
        openblas_mapped=applies and system_openblas_mapped(),
        reexecuted=environ.get(REEXEC_MARKER_ENV) == str(os.getpid()),
        ld_preload=environ.get("LD_PRELOAD", ""),
        openblas_settled=openblas_settled,
    )


THREAD_ENVS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
SPIN_ENV = "OPENBLAS_THREAD_TIMEOUT"
# log2 of the TSC cycles an idle OpenBLAS worker spins (yielding) before it sleeps: 2^24, ~6 ms at
# 2.6 GHz, so a worker stays awake across a step's matmuls and the host's work between two steps
# (asleep at once, 4, each matmul waited for its worker to be woken and scheduled), and sleeps
# when the node idles; OpenBLAS's default, 28, spins ~0.1 s after every call.
SHORT_SPIN = "24"


def blas_threads(cores: int, environ: Mapping[str, str], engine_nodes: int = 1) -> int | None:
    """How many threads OpenBLAS computes an engine node's matmuls with: its share of the `cores`
    the process may run on (shared among the `engine_nodes` started on them together, a local
    cluster's two); at least one. None where the environment already says (OpenBLAS reads it
    when it loads). Measured on the 2-core box (docs/performance.md, "What limits it"): quiet,
    two threads whose idle workers sleep against one made 1.36-1.40x one stream's tokens/s with a
    draft, 1.18x at 8 streams and 1.25x at 32 through HTTP; on a box other work keeps busy one
    won (a call waits for whichever worker has no core): there the operator sets
    `OPENBLAS_NUM_THREADS=1` (docs/operations.md)."""
    if any(environ.get(name, "").strip() for name in THREAD_ENVS):
        return None
    return max(1, cores // max(1, engine_nodes))


def blas_thread_env(cores: int, environ: Mapping[str, str], engine_nodes: int = 1) -> dict[str, str]:
    """What an engine node's OpenBLAS should load with, of what `environ` does not say already:
    its thread count (`blas_threads`) and idle workers that sleep after a short spin (`SHORT_SPIN`)."""
    settings = {}
    threads = blas_threads(cores, environ, engine_nodes)
    if threads is not None:
        settings["OPENBLAS_NUM_THREADS"] = str(threads)
    if not environ.get(SPIN_ENV, "").strip():
        settings[SPIN_ENV] = SHORT_SPIN
    return settings


def set_openblas_threads(count: int) -> bool:
    """Have the OpenBLAS loaded in this process compute with `count` threads, and a child that
    loads it (an engine core) too; False where no OpenBLAS answers."""
    import ctypes

    try:
        setter = ctypes.CDLL(None).openblas_set_num_threads
    except (AttributeError, OSError):
        return False
    setter.argtypes, setter.restype = [ctypes.c_int], None
    setter(count)
    os.environ["OPENBLAS_NUM_THREADS"] = str(count)
    return True


def reexec_with_preload(ld_preload: str, argv: Sequence[str] | None = None,
                        settings: Mapping[str, str] | None = None) -> NoReturn:
    """Replace this process by its own command line (`sys.orig_argv`: interpreter flags, `-m`
    and a launcher script survive) with `LD_PRELOAD` set and `settings` added to its environment;
    the pid stays the same."""
    env = {**os.environ, **(settings or {})}
    if ld_preload:
        env["LD_PRELOAD"] = ld_preload
    else:
        env.pop("LD_PRELOAD", None)
    env[REEXEC_MARKER_ENV] = str(os.getpid())
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()  # flush handlers: exec discards whatever is still buffered
    command = list(argv if argv is not None else sys.orig_argv)
    os.execve(sys.executable, command, env)


def apply_blas_choice(choice: BlasChoice, *, may_reexec: bool = True,
                      environ: Mapping[str, str] = os.environ, engine_nodes: int = 1) -> str:
    """Call before mlx is imported. Returns the BLAS the process will use ("openblas",
    "bundled", "n/a"), re-executes the process when that takes a preload or OpenBLAS's settings
    (`blas_thread_env`, for `engine_nodes` on this process's cores: a node's `--device-shared-by`)
    (`may_reexec`; a process that only starts others passes False and hands them the returned
    value), or exits with a clear message when the choice cannot be honoured."""
    settings = blas_thread_env(len(os.sched_getaffinity(0)), environ, engine_nodes)
    decision = decide_blas_here(choice, environ, openblas_settled=not settings or not may_reexec)
    match decision:
        case KeepProcess(blas=blas, note=note):
            if note:
                log.warning("%s", note)
            elif blas == "n/a" and choice != "auto":
                log.info("--blas %s has no effect here: MLX does not compute through a Linux CPU BLAS",
                         choice)
            return blas
        case ReexecProcess(blas=blas, ld_preload=ld_preload):
            if not may_reexec:
                return blas
            log.debug("re-executing with LD_PRELOAD=%r and %s for --blas %s", ld_preload,
                      settings if blas == "openblas" else "nothing else", choice)
            reexec_with_preload(ld_preload, settings=settings if blas == "openblas" else None)
        case RefuseBlas(message=message):
            raise SystemExit(f"statecore: {message}")
        case _:
            assert_never(decision)


def process_role(pid: int) -> str:
    """A process's `--role` from its command line (else its program's name; "?" when gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    return argv[argv.index("--role") + 1] if "--role" in argv[:-1] else Path(argv[0]).name


def child_pids(pid: int) -> list[int]:
    """The pids of a process's children, from /proc ([] when it is gone)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def blas_of_process_tree(pid: int) -> dict[str, str]:
    """"openblas" or "bundled" for a process and its descendants that compute with mlx, keyed by
    "<role or program> (pid N)": what bench/ prints about a server it started."""
    report: dict[str, str] = {}
    pending = [pid]
    while pending:
        current = pending.pop(0)
        pending += child_pids(current)
        files = mapped_files(current)
        # The router loads mlx only for its tokenizer and never multiplies: its BLAS is moot.
        if process_role(current) != "router" and any("libmlx" in Path(f).name for f in files):
            blas = "openblas" if any(is_system_openblas(f) for f in files) else "bundled"
            report[f"{process_role(current)} (pid {current})"] = blas
    return report


__all__ = [
    "child_pids",
    "process_role",
    "BLAS_CHOICES",
    "CHOICE_ENV",
    "INSTALL_HINT",
    "REEXEC_MARKER_ENV",
    "BlasChoice",
    "BlasDecision",
    "KeepProcess",
    "ReexecProcess",
    "RefuseBlas",
    "THREAD_ENVS",
    "apply_blas_choice",
    "blas_in_use",
    "blas_threads",
    "blas_thread_env",
    "openblas_threads_now",
    "SHORT_SPIN",
    "SPIN_ENV",
    "blas_of_process_tree",
    "cpu_blas_applies",
    "decide_blas",
    "set_openblas_threads",
    "decide_blas_here",
    "default_blas_choice",
    "find_openblas",
    "is_system_openblas",
    "mapped_blas",
    "mapped_files",
    "openblas_candidates",
    "openblas_from_ldconfig",
    "parse_blas_choice",
    "system_openblas_mapped",
]
