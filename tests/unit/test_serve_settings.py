"""Node settings: engine settings read from the environment (bad values warn and fall back, never
crash), and the flags a local cluster hands on to its children."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.cli import build_parser
from adapters.http.api_keys import keys_from
from adapters.serve import node
from adapters.serve.cluster import engine_gpus, forwarded_serving_flags, shared_device_flags
from adapters.serve.flags import resolve_api_keys
from adapters.serve.node import ENGINE_SWITCH_INTERVAL, engine_options, switch_interval
from statecore.scheduling import DECODE_NODE_FLOOR_MULTIPLE, SINGLE_NODE_CPU_FLOOR_MULTIPLE


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, ENGINE_SWITCH_INTERVAL),
        ("0.002", 0.002),
        ("1", 1.0),
        ("abc", ENGINE_SWITCH_INTERVAL),
        ("0", ENGINE_SWITCH_INTERVAL),
        ("-1", ENGINE_SWITCH_INTERVAL),
        ("nan", ENGINE_SWITCH_INTERVAL),
        ("5", ENGINE_SWITCH_INTERVAL),
    ],
)
def test_switch_interval(raw: str | None, expected: float) -> None:
    assert switch_interval(raw) == expected


def test_a_local_cluster_hands_every_flag_set_to_its_children_but_the_secret_and_socket() -> None:
    args = build_parser().parse_args([
        "run", "--log-json", "--log-level", "DEBUG", "--max-in-flight", "7", "--kv-lease", "5",
        "--inject-fault", "prefill", "--inject-fault", "install:slow=1", "--force-disaggregation",
        "--internal-token", "s3cret", "--listen-fd", "5", "--max-batch", "32",  # 32: the default
        "--api-key", "k3y", "--api-key-protects", "metrics, health", "--allowed-origins", "*",
        "--enable-prompt-tokens-details",
    ])
    forwarded = forwarded_serving_flags(args)
    assert forwarded == [  # in the order the flags are declared
        "--force-disaggregation", "--api-key-protects", "health,metrics", "--allowed-origins", "*",
        "--kv-lease", "5.0", "--max-in-flight", "7", "--enable-prompt-tokens-details",
        "--inject-fault", "prefill", "--inject-fault", "install:slow=1",
        "--log-json", "--log-level", "DEBUG",
    ]
    assert "s3cret" not in forwarded and "k3y" not in forwarded and "--listen-fd" not in forwarded
    assert build_parser().parse_args(["run", *forwarded]).max_in_flight == 7  # children accept them


def test_a_default_cluster_hands_nothing_on() -> None:
    assert forwarded_serving_flags(build_parser().parse_args(["run"])) == []


@pytest.mark.parametrize("flags", [
    ["--max-batch", "0"], ["--prefill-batch", "0"], ["--shape-bucket", "-1"], ["--prefill-chunk-size", "-1"],
    ["--max-in-flight", "0"], ["--max-kv-bytes", "0"], ["--kv-buffer-bytes", "-1"],
    ["--local-prefill-below", "-1"], ["--kv-lease", "0"], ["--kv-lease", "inf"],
    ["--request-deadline", "nan"], ["--drain-timeout", "-5"], ["--max-batch", "two"],
    ["--api-key", ""], ["--api-key", "two words"], ["--api-key", "a,b"], ["--api-key-protects", "docs"],
    ["--allowed-origins", "https://app.example/"], ["--allowed-origins", "app.example"],
    ["--chat-template-args", "enable_thinking=false"], ["--chat-template-args", "[1]"],
    ["--chat-template-args", '{"nested": {"a": 1}}'], ["--chat-template-args", '{"tokenize": false}'],
    ["--chat-template-args", '{"x": NaN}'],
])
def test_a_nonsense_setting_is_refused_when_parsed(flags: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", *flags])
    assert exit_.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err


def test_template_args_parse_to_json_that_a_local_cluster_hands_its_router_alone() -> None:
    given = '{ "enable_thinking" : false, "n": 1.5 }'
    args = build_parser().parse_args(["run", "--chat-template-args", given])
    assert args.chat_template_args == '{"enable_thinking": false, "n": 1.5}'
    assert forwarded_serving_flags(args, "router") == ["--chat-template-args", args.chat_template_args]
    assert forwarded_serving_flags(args, "prefill") == forwarded_serving_flags(args, "decode") == []
    again = build_parser().parse_args(["run", "--role", "router", *forwarded_serving_flags(args, "router")])
    assert again.chat_template_args == args.chat_template_args


def test_sane_settings_parse() -> None:
    args = build_parser().parse_args(["run", "--drain-timeout", "0", "--kv-buffer-bytes", "0",
                                      "--local-prefill-below", "0", "--kv-lease", "0.5"])
    settings = (args.drain_timeout, args.kv_buffer_bytes, args.local_prefill_below, args.kv_lease)
    assert settings == (0, 0, 0, 0.5)


def test_api_keys_come_from_the_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert keys_from(["k1"], " k2, ,k1,k3 ") == ("k1", "k2", "k3")
    assert keys_from([], None) == ()
    monkeypatch.setenv("STATECORE_API_KEY", "from-env")
    args = build_parser().parse_args(["run", "--api-key", "k1", "--api-key-protects", "health"])
    resolve_api_keys(args)
    assert args.api_keys.keys == ("k1", "from-env") and args.api_keys.protects == {"health"}
    monkeypatch.setenv("STATECORE_API_KEY", "bad key")
    with pytest.raises(SystemExit, match="STATECORE_API_KEY: an API key must be printable"):
        resolve_api_keys(build_parser().parse_args(["run"]))
    monkeypatch.delenv("STATECORE_API_KEY")
    args = build_parser().parse_args(["run"])
    resolve_api_keys(args)
    assert args.api_keys is None  # no key: the public API is open
    with pytest.raises(SystemExit, match="--api-key-protects needs --api-key"):
        resolve_api_keys(build_parser().parse_args(["run", "--api-key-protects", "metrics"]))


@pytest.mark.parametrize(("given", "engine_gets"), [([], None), (["--preallocate-slots", "on"], True),
                                                    (["--preallocate-slots", "off"], False)])
def test_the_memory_flags_reach_the_engine(given: list[str], engine_gets: bool | None) -> None:
    args = build_parser().parse_args(["run", "--role", "decode", "--device-shared-by", "3", *given])
    options = engine_options(args, "decode")
    assert options["preallocate_slots"] is engine_gets
    assert options["device_shared_by"] == 3


@pytest.mark.parametrize(("role", "given", "cuda", "ms", "floors"), [
    ("decode", [], False, None, DECODE_NODE_FLOOR_MULTIPLE),
    ("decode", [], True, None, DECODE_NODE_FLOOR_MULTIPLE),
    ("single", [], False, None, SINGLE_NODE_CPU_FLOOR_MULTIPLE), ("single", [], True, 0.0, None),
    ("prefill", [], False, 0.0, None),
    ("single", ["--step-target-ms", "50"], False, 50.0, None),
    ("decode", ["--step-target-ms", "0"], True, 0.0, None),
    ("single", ["--step-target-floors", "16"], True, None, 16.0),
    ("decode", ["--step-target-floors", "8", "--step-target-ms", "40"], False, 40.0, None)])
def test_the_step_target_by_role_and_backend(role: str, given: list[str], cuda: bool, ms: float | None,
                                             floors: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode node's target is 4 of its measured decode steps, a single node's on the CPU 2; a
    single node on MLX's CUDA backend and a prefill node run the fixed budget unless given a
    target, in ms or in such steps (ms wins)."""
    monkeypatch.setattr(node, "mlx_cuda_installed", lambda: cuda)
    options = engine_options(build_parser().parse_args(["run", "--role", role, *given]), role)
    assert options["step_target_ms"] == ms
    assert options.get("step_target_floors") == floors


def test_a_local_cluster_tells_its_engine_nodes_they_share_one_device() -> None:
    default = build_parser().parse_args(["run"])
    assert shared_device_flags(default, None) == ["--device-shared-by", "2"]
    assert shared_device_flags(default, ("0", "1")) == []  # a GPU each: nothing shared
    given = build_parser().parse_args(["run", "--device-shared-by", "4"])
    assert shared_device_flags(given, None) == []  # forwarded as given instead
    assert forwarded_serving_flags(given, "decode") == ["--device-shared-by", "4"]


def fake_nvidia_smi(tmp_path: Path, listing: str) -> dict[str, str]:
    """A PATH whose only `nvidia-smi` prints `listing` (what `--query-gpu=index` prints)."""
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '{listing}'\n")
    tool.chmod(0o755)
    return {"PATH": str(tmp_path)}


def test_a_local_cluster_puts_its_engine_nodes_on_a_gpu_each_where_there_are_two(tmp_path: Path) -> None:
    assert engine_gpus(fake_nvidia_smi(tmp_path, "0\\n1\\n2\\n"), cuda_backend=True) == ("0", "1")
    assert engine_gpus(fake_nvidia_smi(tmp_path, "0\\n"), cuda_backend=True) is None
    assert engine_gpus({"PATH": str(tmp_path / "none")}, cuda_backend=True) is None
    assert engine_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"}, cuda_backend=True) == ("3", "5")
    assert engine_gpus({"CUDA_VISIBLE_DEVICES": "3"}, cuda_backend=True) is None
    # MLX on the CPU (or Metal) computes on one device whatever GPUs the machine has
    assert engine_gpus({"CUDA_VISIBLE_DEVICES": "0,1"}, cuda_backend=False) is None
