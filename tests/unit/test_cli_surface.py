"""The command line as a new user meets it: `run --help` explains every public flag and shows
no test-only ones; `statecore spec` away from the repository says so in one line; a too-long
prompt is refused without transformers' own warning."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from adapters.cli import build_parser, main
from adapters.frontend.frontend import Frontend
from adapters.serve import flags as flags_module
from adapters.serve.flags import demo_model_dir
from tests.integration.fake_backend import FakeBackend


def run_help() -> str:
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr,index]
    text: str = run.format_help()
    return text


def test_run_help_explains_every_public_flag_and_hides_test_only_ones() -> None:
    text = run_help()
    for flag in ("--host", "--port", "--prefill", "--decode", "--log-level", "--model"):
        line = next(line for line in text.splitlines() if line.strip().startswith(flag))
        described = line.split(flag, 1)[1].split(maxsplit=1)
        assert len(described) == 2 or text.split(line, 1)[1].startswith("\n" + " " * 10), line
    assert "--inject-fault" not in text and "--fault-marker" not in text
    assert "Hugging Face" in text


def test_spec_outside_the_repository_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["spec"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "no specs directory" in captured.err


def test_spec_with_a_missing_file_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "specs").mkdir()
    assert main(["spec", "--dir", str(tmp_path / "specs")]) == 1
    assert "request_router.toml is missing" in capsys.readouterr().out


def test_spec_never_writes_the_oracle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """specs/ are the model tests' hand-written oracle: no command regenerates them."""
    (tmp_path / "specs").mkdir()
    assert main(["spec", "--dir", str(tmp_path / "specs"), "--write"]) == 2
    assert "reviewed documents" in capsys.readouterr().err
    assert list((tmp_path / "specs").iterdir()) == []


def test_a_too_long_prompt_logs_no_transformers_warning() -> None:
    frontend = Frontend.load(demo_model_dir(), FakeBackend())
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    transformers_log = logging.getLogger("transformers")  # it does not propagate to the root
    transformers_log.addHandler(handler)
    try:
        ids = trio.run(frontend.prompts.encode_prompt, "word " * 2000)
    finally:
        transformers_log.removeHandler(handler)
    assert len(ids) > 512  # longer than the demo model's context: the front end refuses it later
    assert not [m for m in seen if "sequence length" in m], seen


@pytest.mark.parametrize(("flags", "cuda", "core"), [
    ([], False, "thread"),
    ([], True, "process"),
    (["--tensor-parallel", "2"], True, "thread"),
    (["--pipeline-parallel", "2"], True, "thread"),
    (["--engine-core", "thread"], True, "thread"),
    (["--engine-core", "process"], False, "process"),
])
def test_the_engine_core_defaults_to_a_process_where_mlx_runs_on_cuda(
        flags: list[str], cuda: bool, core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flags_module, "mlx_cuda_installed", lambda: cuda)
    args = build_parser().parse_args(["run", "--role", "single", *flags])
    assert args.engine_core == (flags[1] if flags[:1] == ["--engine-core"] else "auto")
    flags_module.resolve_engine_core(args)
    assert args.engine_core == core


def test_choosing_the_engine_core_imports_no_mlx() -> None:
    # a node whose core is a process never imports mlx, the choice of core included
    code = ("import sys; from adapters.serve.flags import mlx_cuda_installed; "
            "print(type(mlx_cuda_installed()).__name__, 'mlx' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONPATH": "src"})
    assert done.stdout.split() == ["bool", "False"]
