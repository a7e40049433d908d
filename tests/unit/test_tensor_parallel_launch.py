"""`statecore run --tensor-parallel N --hostfile F` hands the same command to mlx.launch."""

from __future__ import annotations

from adapters.serve.tensor_parallel import heartbeat_s, mlx_launch_argv


def test_the_command_reaches_every_host_without_the_hostfile_after_a_separator() -> None:
    argv = ["run", "--role", "decode", "--hostfile", "hosts.json", "--host", "10.0.0.21",
            "--tensor-parallel", "2", "--hostfile=other.json", "--port", "9002"]
    assert mlx_launch_argv(argv, launcher="/v/mlx.launch", python="/v/python", backend="jaccl",
                           hostfile="hosts.json") == [
        "/v/mlx.launch", "--backend", "jaccl", "--hostfile", "hosts.json", "--",
        "/v/python", "-m", "adapters.cli", "run", "--role", "decode", "--host", "10.0.0.21",
        "--tensor-parallel", "2", "--port", "9002",
    ]


def test_the_heartbeat_stays_well_inside_the_stall_timeout() -> None:
    assert heartbeat_s(180.0) == 1.0
    assert heartbeat_s(2.0) == 0.5
    assert heartbeat_s(0.0) == 1.0  # no watchdog: still a heartbeat
