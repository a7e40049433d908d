"""The command line as a newcomer meets it (issue 36): `statecore run --help` grouped by what a
flag is for and which roles read it, short by default; a mistake at start-up is one line that
names the role and what to do; a flag for another role says so; a local cluster hands each node
only its own flags; `statecore spec` says when the tables match; Mermaid's front matter has its
`title:`."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from adapters.cli import build_parser, main
from adapters.serve.cluster import forwarded_serving_flags
from adapters.serve.flag_roles import FLAG_GROUPS, ROLES, flags_for_other_roles, roles_reading
from statecore.diagram import render
from statecore.table import MACHINES

ROOT = Path(__file__).resolve().parents[2]


def run_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices["run"]
    return parser


def help_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["run", *argv])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_every_flag_is_in_a_group_that_says_which_roles_read_it() -> None:
    parser = run_parser()
    titles = {group.title for group in FLAG_GROUPS}
    grouped = {a.dest for g in parser._action_groups if g.title in titles for a in g._group_actions}
    flags = {a.dest for a in parser._actions if a.option_strings and a.dest not in {"help", "help_all"}}
    assert flags == grouped, flags ^ grouped
    readers = roles_reading(parser)
    assert readers["prefill"] == {"router"} and readers["max_batch"] >= {"single", "prefill", "decode"}
    assert "router" not in readers["max_batch"] and "cluster" in readers["max_batch"]


def test_default_help_is_short_and_points_to_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["--help"], capsys)
    assert len(text.splitlines()) < 60, len(text.splitlines())
    assert "--help-all" in text and "--role ROLE --help" in text
    for group in FLAG_GROUPS:
        assert group.title in text
    assert "--max-batch" not in text and "--model" in text


def test_role_help_lists_the_flags_that_role_reads(capsys: pytest.CaptureFixture[str]) -> None:
    router = help_of(["--role", "router", "--help"], capsys)
    assert "--prefill URL" in router and "--local-prefill-below" in router
    assert "--max-batch" not in router and "--kv-memory-bytes" not in router
    decode = help_of(["--role", "decode", "--help"], capsys)
    assert "--max-batch" in decode and "--kv-buffer-bytes" in decode and "--local-prefill-below" not in decode


def test_help_all_lists_every_flag_under_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(["--help-all"], capsys)
    for group in FLAG_GROUPS:
        assert f"\n{group.title}:" in text
    at = {flag: text.index(f"  {flag}") for flag in ("--max-batch", "--api-key", "--prefill-port")}
    engine, api = text.index("\nengine: batching"), text.index("\npublic API")
    assert engine < at["--max-batch"] and api < at["--api-key"] < engine


def one_line(exit_: pytest.ExceptionInfo[SystemExit]) -> str:
    said = str(exit_.value.code)
    assert len(said.splitlines()) == 1 and "Traceback" not in said, said
    return said


def test_a_directory_that_is_not_a_model_is_one_line_naming_the_role(tmp_path: Path) -> None:
    for role, words in (("single", "single node"), ("cluster", "local cluster")):
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--role", role, "--model", str(tmp_path)])
        said = one_line(exit_)
        assert said.startswith(f"statecore: {words}: ") and "no config.json" in said, said


def test_a_missing_path_is_one_line_naming_the_role(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--role", "router", "--model", str(tmp_path / "no" / "such")])
    assert one_line(exit_).startswith("statecore: router: ")


def test_a_port_in_use_is_one_line_naming_the_role_and_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--role", "router", "--port", str(port), "--prefill", "http://p", "--decode", "http://d"])
    said = one_line(exit_)
    assert said.startswith("statecore: router: cannot listen on") and "--port" in said, said


def test_a_local_clusters_inner_port_in_use_names_its_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["run", "--port", "0", "--decode-port", str(port)])
    said = one_line(exit_)
    assert said.startswith(f"statecore: local cluster: cannot listen on 127.0.0.1:{port}"), said
    assert "--decode-port" in said, said


def test_a_bad_flag_value_is_one_line_naming_the_role(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--role", "decode", "--max-batch", "two"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("statecore run --role decode: argument --max-batch: ") and "--help" in err


def test_a_flag_for_another_role_is_named_once() -> None:
    args = build_parser().parse_args(["run", "--role", "router", "--max-batch", "8", "--prefill", "http://p"])
    assert args.role == "router"
    lines = flags_for_other_roles(run_parser(), args)
    assert len(lines) == 1, lines
    assert lines[0].startswith("router: --max-batch is read by the local cluster, "), lines
    single = build_parser().parse_args(["run", "--role", "single", "--prefill", "http://p"])
    (line,) = flags_for_other_roles(run_parser(), single)
    assert line.startswith("single node: --prefill is read by the router only"), line


def test_a_local_cluster_hands_each_node_only_its_own_flags() -> None:
    args = build_parser().parse_args(["run", "--max-batch", "8", "--force-disaggregation", "--kv-lease", "5",
                                      "--prefix-pull", "never", "--keep-conversations", "off"])
    by_role = {role: forwarded_serving_flags(args, role) for role in ("prefill", "decode", "router")}
    assert by_role["router"] == ["--force-disaggregation", "--kv-lease", "5.0"]
    assert by_role["prefill"] == ["--max-batch", "8", "--prefix-pull", "never", "--kv-lease", "5.0"]
    assert by_role["decode"] == ["--max-batch", "8", "--keep-conversations", "off", "--kv-lease", "5.0"]
    for role, flags in by_role.items():  # and each node takes them without a warning
        child = build_parser().parse_args(["run", "--role", role, *flags])
        assert flags_for_other_roles(run_parser(), child) == [], role
    assert set(ROLES) == {"cluster", "single", "prefill", "decode", "router"}


def test_spec_says_when_every_table_matches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "--dir", str(ROOT / "specs")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"statecore spec: the {len(MACHINES)} tables match"), out


def test_mermaid_front_matter_names_its_title() -> None:
    for machine in MACHINES.values():
        text = render(machine, "mermaid")
        assert text.startswith(f"---\ntitle: {machine.title}\n---\n"), text[:80]
