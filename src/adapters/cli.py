"""The `statecore` command line: `run`, `diagram`, `spec`.

Parses arguments and hands off to the adapters that do the work. The `run` flags are a
public contract (see README): keep them stable. This module may import anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adapters.blas import BlasChoice, default_blas_choice, parse_blas_choice
from statecore.diagram import render, render_markdown
from statecore.spec import compare, load_spec, spec_from_machine
from statecore.table import MACHINES


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="serve a model (no arguments: a local demo cluster)")
    run.add_argument(
        "--role",
        choices=["cluster", "single", "prefill", "decode", "router"],
        default="cluster",
        help="what this process is (default: a local router+prefill+decode cluster)",
    )
    run.add_argument("--model", type=Path, default=None, metavar="DIR|REPO",
                     help="a model directory (mlx-lm layout) or a Hugging Face repo id such as "
                          "mlx-community/Qwen3-0.6B-4bit (taken from the Hugging Face cache, else "
                          "downloaded, as mlx-lm does); default: the embedded demo model")
    run.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1; a local cluster's router)")
    run.add_argument("--port", type=int, default=8000,
                     help="port to listen on (default 8000; a local cluster's router, its nodes "
                          "take free ports)")
    run.add_argument("--prefill", action="append", default=[], metavar="URL",
                     help="router: a prefill node's URL; repeat for several (at least one)")
    run.add_argument("--decode", action="append", default=[], metavar="URL",
                     help="router: a decode node's URL; repeat for several (at least one)")
    run.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory to bring its own architecture file (model_file)",
    )
    run.add_argument(
        "--blas",
        type=_blas_choice,
        default=default_blas_choice(),
        metavar="{auto,openblas,bundled}",
        help="Linux CPU: the BLAS under MLX's matmuls; auto uses the system OpenBLAS when installed "
        "(~3-10x faster prefill), else MLX's bundled one. Every node of a cluster needs the same "
        "(env STATECORE_BLAS, default auto)",
    )
    from adapters.serve.flags import add_serving_flags

    add_serving_flags(run)


def _blas_choice(text: str) -> BlasChoice:
    try:
        return parse_blas_choice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_diagram(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    diagram = sub.add_parser("diagram", help="render the state machines from their tables")
    diagram.add_argument("--machine", choices=sorted(MACHINES), default=None)
    diagram.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    diagram.add_argument(
        "--markdown", action="store_true", help="print docs/state-machines.md instead"
    )


def _add_spec(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    spec = sub.add_parser("spec", help="compare specs/ (reviewed by hand) with the tables")
    spec.add_argument("--dir", type=Path, default=Path("specs"))
    # specs/ are the model tests' oracle: a command that rewrote them from the tables would let
    # the oracle follow a wrong table, so the old flag only says so
    spec.add_argument("--write", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="statecore",
        description="Disaggregated LLM serving on MLX, every request an explicit state machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_diagram(sub)
    _add_spec(sub)
    return parser


def _diagram(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    names = [args.machine] if args.machine else list(MACHINES)
    blocks = [render(MACHINES[name], args.format) for name in names]
    sys.stdout.write("\n".join(blocks))
    return 0


def _spec(args: argparse.Namespace) -> int:
    if args.write:
        print("statecore spec: specs/ are reviewed documents, the model tests' oracle, and are "
              "never written from the tables: edit the TOML by hand (`statecore spec` lists what "
              "differs)", file=sys.stderr)
        return 2
    if not args.dir.is_dir():
        print(f"statecore spec: no specs directory at {args.dir.resolve()}: run it from the "
              "repository root, or give --dir", file=sys.stderr)
        return 2
    status = 0
    for machine in MACHINES.values():
        path = args.dir / f"{machine.name}.toml"
        from_table = spec_from_machine(machine)
        if not path.is_file():
            print(f"{machine.name}: {path} is missing (write it by hand: it is the tests' oracle)")
            status = 1
            continue
        problems = compare(load_spec(path), from_table)
        for line in problems:
            print(f"{machine.name}: {line}")
        status |= bool(problems)
    return status


def _run(args: argparse.Namespace) -> int:
    from adapters.serve.command import run_command

    return run_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "diagram":
        return _diagram(args)
    if args.command == "spec":
        return _spec(args)
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
