"""The BLAS choice: parsing, the pure start-up decision, and finding OpenBLAS from ldconfig."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.blas import (
    INSTALL_HINT,
    SHORT_SPIN,
    SPIN_ENV,
    THREAD_ENVS,
    BlasChoice,
    BlasDecision,
    KeepProcess,
    ReexecProcess,
    RefuseBlas,
    blas_thread_env,
    blas_threads,
    decide_blas,
    default_blas_choice,
    is_system_openblas,
    openblas_from_ldconfig,
    parse_blas_choice,
)
from adapters.cli import build_parser

LIB = Path("/usr/lib/x86_64-linux-gnu/libopenblas.so.0")


@pytest.mark.parametrize(("text", "choice"), [("auto", "auto"), ("OpenBLAS", "openblas"),
                                              (" bundled\n", "bundled")])
def test_parse_choice(text: str, choice: BlasChoice) -> None:
    assert parse_blas_choice(text) == choice


@pytest.mark.parametrize("text", ["", "mkl", "open blas", "autox"])
def test_parse_choice_refuses_others(text: str) -> None:
    with pytest.raises(ValueError, match="auto, openblas, bundled"):
        parse_blas_choice(text)


def test_flag_env_default_and_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    assert default_blas_choice({}) == "auto"
    assert default_blas_choice({"STATECORE_BLAS": "bundled"}) == "bundled"
    assert build_parser().parse_args(["run", "--blas", "OPENBLAS"]).blas == "openblas"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--blas", "fast"])
    assert "argument --blas: BLAS choice must be one of" in capsys.readouterr().err


def _decide(choice: BlasChoice, *, applies: bool = True, openblas: Path | None = LIB, mapped: bool = False,
            reexecuted: bool = False, ld_preload: str = "", settled: bool = True) -> BlasDecision:
    return decide_blas(choice, applies=applies, openblas=openblas, openblas_mapped=mapped,
                       reexecuted=reexecuted, ld_preload=ld_preload, openblas_settled=settled)


@pytest.mark.parametrize("choice", ["auto", "openblas", "bundled"])
def test_off_linux_cpu_nothing_happens(choice: BlasChoice) -> None:
    # a GPU build or macOS: no re-exec, no refusal, even when OpenBLAS is asked for and missing
    assert _decide(choice, applies=False, openblas=None) == KeepProcess("n/a")


@pytest.mark.parametrize("choice", ["auto", "openblas"])
def test_openblas_wanted(choice: BlasChoice) -> None:
    assert _decide(choice, ld_preload="libfoo.so") == ReexecProcess("openblas", f"{LIB} libfoo.so")
    assert _decide(choice, mapped=True) == KeepProcess("openblas")  # already preloaded: no re-exec
    # preloaded before OpenBLAS's settings were in the environment: load it again with them, once
    again = ReexecProcess("openblas", str(LIB))
    assert _decide(choice, mapped=True, settled=False, ld_preload=str(LIB)) == again
    assert _decide(choice, mapped=True, settled=False, reexecuted=True) == KeepProcess("openblas")
    assert _decide("bundled", settled=False) == KeepProcess("bundled")  # nothing of OpenBLAS's to settle


def test_openblas_missing() -> None:
    refused = _decide("openblas", openblas=None)
    assert isinstance(refused, RefuseBlas) and INSTALL_HINT in refused.message
    fallback = _decide("auto", openblas=None)
    assert isinstance(fallback, KeepProcess) and fallback.blas == "bundled"
    assert fallback.note is not None and INSTALL_HINT in fallback.note


def test_never_reexec_twice() -> None:
    # the preload did not take: refuse or fall back, never loop
    assert isinstance(_decide("openblas", reexecuted=True), RefuseBlas)
    fallback = _decide("auto", reexecuted=True)
    assert isinstance(fallback, KeepProcess) and fallback.blas == "bundled" and fallback.note
    assert isinstance(_decide("bundled", mapped=True, reexecuted=True), RefuseBlas)


def test_bundled_removes_an_inherited_preload() -> None:
    assert _decide("bundled") == KeepProcess("bundled")
    assert _decide("bundled", openblas=None) == KeepProcess("bundled")
    assert _decide("bundled", mapped=True, ld_preload=f"/x/libfoo.so:{LIB}") == ReexecProcess(
        "bundled", "/x/libfoo.so")
    assert _decide("bundled", mapped=True, ld_preload=str(LIB)) == ReexecProcess("bundled", "")


@pytest.mark.parametrize(("path", "system"), [
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so", True),
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", True),  # Debian's alternative
    ("/usr/lib64/libopenblasp.so.0", True),
    ("libopenblas.so.0", True),
    # numpy's private copy (renamed symbols) never serves MLX
    ("/v/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so", False),
    ("/v/lib/python3.11/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0", False),
    ("/usr/lib/x86_64-linux-gnu/libblas.so.3", False),
])
def test_which_mappings_are_a_system_openblas(path: str, system: bool) -> None:
    assert is_system_openblas(path) is system


LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibopenblas.so.0 (libc6) => /usr/lib/i386-linux-gnu/libopenblas.so.0
\tlibopenblas.so.0 (libc6,x86-64) => /lib/x86_64-linux-gnu/libopenblas.so.0
\tlibblas.so.3 (libc6,x86-64) => /lib/x86_64-linux-gnu/libblas.so.3
"""


def test_openblas_from_ldconfig() -> None:
    assert openblas_from_ldconfig(LDCONFIG, "x86_64") == Path("/lib/x86_64-linux-gnu/libopenblas.so.0")
    assert openblas_from_ldconfig(LDCONFIG, "aarch64") is None  # only foreign-architecture copies
    assert openblas_from_ldconfig("\tlibblas.so.3 (libc6,x86-64) => /x/libblas.so.3\n", "x86_64") is None
    assert openblas_from_ldconfig("", "x86_64") is None


def test_the_cli_reaches_the_blas_step_before_mlx_loads() -> None:
    # LD_PRELOAD only works through a re-exec, which is cheap only while mlx is not loaded yet;
    # and the router must stay a tokenizer-only process.
    probe = ("import sys, adapters.cli, adapters.serve.command; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("cores", "nodes", "environ", "threads"), [
    (2, 1, {}, 2),  # the CPU box: a node alone on it computes on both cores
    (1, 1, {}, 1),  # a node pinned to one core
    (16, 1, {}, 16),
    (4, 2, {}, 2),  # a local cluster's two engine nodes: two cores each
    (16, 2, {}, 8),
    (2, 2, {}, 1),
    (1, 2, {}, 1),  # never zero
    (2, 1, {"OPENBLAS_NUM_THREADS": "2"}, None),  # the user's count, read by OpenBLAS at load, stands
    (2, 2, {"OMP_NUM_THREADS": "4"}, None),
    (2, 1, {"GOTO_NUM_THREADS": "1"}, None),
    (3, 1, {"OPENBLAS_NUM_THREADS": " "}, 3),  # an empty setting says nothing
])
def test_blas_threads(cores: int, nodes: int, environ: dict[str, str], threads: int | None) -> None:
    assert blas_threads(cores, environ, nodes) == threads


@pytest.mark.parametrize(("environ", "settings"), [
    ({}, {"OPENBLAS_NUM_THREADS": "4", SPIN_ENV: SHORT_SPIN}),
    ({SPIN_ENV: "20"}, {"OPENBLAS_NUM_THREADS": "4"}),  # the user's spin stands
    ({"OPENBLAS_NUM_THREADS": "1"}, {SPIN_ENV: SHORT_SPIN}),  # so does the user's count: the spin still goes
    ({"OMP_NUM_THREADS": "2", SPIN_ENV: "28"}, {}),
])
def test_blas_thread_env_adds_what_the_environment_does_not_say(environ: dict[str, str],
                                                                settings: dict[str, str]) -> None:
    assert blas_thread_env(4, environ) == settings


_PROBE = ("import ctypes, os, subprocess, sys; from adapters.blas import apply_blas_choice; "
          "assert apply_blas_choice('auto') == 'openblas'; "
          "get = 'import ctypes, os; print(ctypes.CDLL(None).openblas_get_num_threads(), "
          "os.environ.get(\"OPENBLAS_THREAD_TIMEOUT\"))'; "
          "child = subprocess.run([sys.executable, '-c', get], capture_output=True, text=True); "
          "print(ctypes.CDLL(None).openblas_get_num_threads(), os.environ.get('OPENBLAS_THREAD_TIMEOUT'), "
          "os.environ.get('STATECORE_BLAS_REEXEC_PID') == str(os.getpid()), child.stdout.strip())")


@pytest.mark.skipif(not LIB.exists(), reason="needs the system OpenBLAS (apt-get install libopenblas0)")
@pytest.mark.parametrize("one_core", [False, True])
def test_a_node_loads_openblas_on_its_cores_with_a_short_idle_spin_and_its_children_inherit(
        one_core: bool) -> None:
    # A process started with OpenBLAS already preloaded (as benches and some operators start a node)
    # loads it again, once, with its settings: a thread per core of its affinity mask, and
    # idle workers that sleep after a short spin. A child that loads OpenBLAS (an engine core) too.
    cores = sorted(os.sched_getaffinity(0))[:1] if one_core else sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_ENVS, SPIN_ENV)}
    env["LD_PRELOAD"] = str(LIB)
    out = subprocess.run(["taskset", "-c", ",".join(map(str, cores)), sys.executable, "-c", _PROBE],
                         capture_output=True, text=True, check=True, env=env)
    threads = str(len(cores))
    assert out.stdout.split() == [threads, SHORT_SPIN, "True", threads, SHORT_SPIN], out.stderr


@pytest.mark.skipif(not LIB.exists(), reason="needs the system OpenBLAS (apt-get install libopenblas0)")
def test_the_environment_s_openblas_settings_stand() -> None:
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_ENVS, SPIN_ENV)}
    env.update(LD_PRELOAD=str(LIB), OPENBLAS_NUM_THREADS="1", OPENBLAS_THREAD_TIMEOUT="28")
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["1", "28", "False", "1", "28"], out.stderr  # no re-exec either
