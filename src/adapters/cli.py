"""The `statecore` command line: `run`, `diagram`, `spec`.

Parses arguments and hands off to the adapters that do the work. The `run` flags are a
public contract (see README): keep them stable. This module may import anything.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from adapters.blas import BlasChoice, default_blas_choice, parse_blas_choice
from adapters.serve.flag_roles import (
    CLUSTER,
    FLAG_GROUPS,
    ROLES,
    ROUTER,
    SERVE,
    flag_group,
    flags_for_other_roles,
    roles_reading,
)
from adapters.serve.flags import add_serving_flags
from statecore.diagram import render, render_markdown
from statecore.spec import compare, load_spec, spec_from_machine
from statecore.table import MACHINES


class _Parser(argparse.ArgumentParser):
    """A parse error is one line that says where to look, not the whole usage (`statecore run`
    has dozens of flags): `statecore run --role router: argument --port: ... (see ...)`."""

    role_hint: str | None = None

    def error(self, message: str) -> NoReturn:
        where = f"{self.prog} --role {self.role_hint}" if self.role_hint else self.prog
        helped = f"{self.prog} --role {self.role_hint} --help" if self.role_hint else f"{self.prog} --help"
        self.exit(2, f"{where}: {message} ({helped} lists the flags)\n")


class _ShortHelp(argparse.Action):
    """`statecore run --help`: the flags most people need and a line for each group of the others;
    after `--role R` (not the local cluster), the flags role R reads, grouped. `--help-all`: every
    flag."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        role = getattr(namespace, "role", "cluster")  # set when --role came before --help
        sys.stdout.write(short_help(parser) if role == "cluster" else role_help(parser, role))
        parser.exit(0)


class _FullHelp(_ShortHelp):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        sys.stdout.write(parser.format_help())
        parser.exit(0)


ESSENTIAL_FLAGS = ("--role", "--model", "--host", "--port", "--prefill", "--decode", "--api-key",
                   "--log-level", "--log-transitions")


def _help_with(parser: argparse.ArgumentParser, sections: list[tuple[str, list[argparse.Action]]],
               epilog: str) -> str:
    formatter = parser._get_formatter()
    formatter.add_usage(parser.usage, [], [])
    formatter.add_text(parser.description)
    for title, actions in sections:
        formatter.start_section(title)
        formatter.add_arguments(actions)
        formatter.end_section()
    formatter.add_text(epilog)
    return formatter.format_help()


def short_help(parser: argparse.ArgumentParser) -> str:
    """The flags most people need, then one line per group of the others."""
    visible = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    essential = [a for flag in ESSENTIAL_FLAGS for a in visible if flag in a.option_strings]
    groups = [g for g in parser._action_groups if g.title in {fg.title for fg in FLAG_GROUPS}]
    others = "\n".join(
        f"  {g.title}: {len([a for a in g._group_actions if a.help != argparse.SUPPRESS])} flags"
        for g in groups)
    epilog = (f"More flags, by what they are for:\n{others}\n\n"
              "statecore run --help-all         every flag, in these groups\n"
              f"statecore run --role ROLE --help the flags one role reads (ROLE: {', '.join(ROLES[1:])})")
    return _help_with(parser, [("most used", essential)], epilog)


def role_help(parser: argparse.ArgumentParser, role: str) -> str:
    """Every flag `role` reads, under its group."""
    readers = roles_reading(parser)
    sections = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help != argparse.SUPPRESS and role in readers.get(a.dest, frozenset())]
        if actions and group.title in {fg.title for fg in FLAG_GROUPS}:
            sections.append((group.title or "", actions))
    return _help_with(parser, sections, "statecore run --help-all lists every role's flags.")


def _add_run(sub: argparse._SubParsersAction[_Parser]) -> None:
    run = sub.add_parser("run", help="serve a model (no arguments: a local demo cluster)", add_help=False,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         usage="statecore run [--role ROLE] [--model DIR|REPO] [--host H] [--port N] "
                               "[flags ...]",
                         description="Serve a model: a local router+prefill+decode cluster (the default),\n"
                                     "or one role of a cluster spread over machines.")
    for group in FLAG_GROUPS:  # --help-all shows the groups in this order
        flag_group(run, group)
    helps = run.add_argument_group("help")
    helps.add_argument("-h", "--help", action=_ShortHelp,
                       help="the flags most people need (with --role ROLE first: that role's flags)")
    helps.add_argument("--help-all", action=_FullHelp, help="every flag, grouped by what it is for")
    serve = flag_group(run, SERVE)
    serve.add_argument(
        "--role",
        choices=ROLES,
        default="cluster",
        help="what this process is (default: a local router+prefill+decode cluster)",
    )
    serve.add_argument("--model", type=Path, default=None, metavar="DIR|REPO",
                       help="a model directory (mlx-lm layout) or a Hugging Face repo id such as "
                            "mlx-community/Qwen3-0.6B-4bit (taken from the Hugging Face cache, else "
                            "downloaded, as mlx-lm does); default: the embedded demo model")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; a local cluster's router)")
    serve.add_argument("--port", type=int, default=8000,
                       help="port to listen on (default 8000; a local cluster's router, its nodes "
                            "take --prefill-port and --decode-port)")
    router = flag_group(run, ROUTER)
    router.add_argument("--prefill", action="append", default=[], metavar="URL",
                        help="router: a prefill node's URL; repeat for several (at least one)")
    router.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="router: a decode node's URL; repeat for several (at least one)")
    serve.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="engine nodes: allow a model directory to bring its own architecture file (model_file)",
    )
    serve.add_argument(
        "--blas",
        type=_blas_choice,
        default=default_blas_choice(),
        metavar="{auto,openblas,bundled}",
        help="engine nodes on a Linux CPU: the BLAS under MLX's matmuls; auto uses the system OpenBLAS "
        "when installed (~3-10x faster prefill), else MLX's bundled one. Every node of a cluster needs "
        "the same (env STATECORE_BLAS, default auto)",
    )
    cluster = flag_group(run, CLUSTER)
    cluster.add_argument("--prefill-port", type=int, default=0, metavar="N",
                         help="the local cluster's prefill node listens on 127.0.0.1:N (default 0: a "
                              "port the system picks)")
    cluster.add_argument("--decode-port", type=int, default=0, metavar="N",
                         help="the local cluster's decode node listens on 127.0.0.1:N (default 0: a "
                              "port the system picks)")
    add_serving_flags(run)


def _blas_choice(text: str) -> BlasChoice:
    try:
        return parse_blas_choice(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _add_diagram(sub: argparse._SubParsersAction[_Parser]) -> None:
    diagram = sub.add_parser("diagram", help="render the state machines from their tables")
    diagram.add_argument("--machine", choices=sorted(MACHINES), default=None)
    diagram.add_argument("--format", choices=["mermaid", "dot"], default="mermaid")
    diagram.add_argument(
        "--markdown", action="store_true", help="print docs/state-machines.md instead"
    )


def _add_spec(sub: argparse._SubParsersAction[_Parser]) -> None:
    spec = sub.add_parser("spec", help="compare specs/ (reviewed by hand) with the tables")
    spec.add_argument("--dir", type=Path, default=Path("specs"))
    # specs/ are the model tests' oracle: a command that rewrote them from the tables would let
    # the oracle follow a wrong table, so the old flag only says so
    spec.add_argument("--write", action="store_true", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="statecore",
        description="Disaggregated LLM serving on MLX, every request an explicit state machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_run(sub)
    _add_diagram(sub)
    _add_spec(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> _Parser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: _Parser = sub.choices[name]
    return found


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
    if status == 0:
        print(f"statecore spec: the {len(MACHINES)} tables match {args.dir}/ "
              f"({', '.join(MACHINES)})")
    return status


def _run(args: argparse.Namespace) -> int:
    from adapters.serve.command import run_command

    return run_command(args)


def _role_given(argv: Sequence[str]) -> str | None:
    """`--role R` (or `--role=R`) in a `run` command line, for its errors, before it is parsed."""
    for i, arg in enumerate(argv):
        if arg == "--role" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--role="):
            return arg.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    run = _subparser(parser, "run")
    run.role_hint = _role_given(argv) if argv[:1] == ["run"] else None
    args = parser.parse_args(argv)
    if args.command == "run":
        args.other_role_flags = flags_for_other_roles(run, args)
    if args.command == "diagram":
        return _diagram(args)
    if args.command == "spec":
        return _spec(args)
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
