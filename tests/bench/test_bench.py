"""The measuring helpers of `orchard bench` against real processes and sockets of this host."""

from __future__ import annotations

import os
import socket
import time

import pytest

from orchard_env.bench_host import agent_memory, cpu_seconds, listener_pid, stat_fields


def test_listener_pid_finds_the_process_listening_on_a_port() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert listener_pid(port) is None  # bound, not listening
        listener.listen()
        assert listener_pid(port) == os.getpid()


def test_cpu_seconds_grows_with_work() -> None:
    before = cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.1


def test_agent_memory_sums_the_listing_and_refuses_an_empty_one() -> None:
    assert agent_memory("1 10240 11264 9216\n7 2048 3072 1024\n") == {
        "agent processes": 2,
        "agent PSS MB": 12.0,
        "agent RSS MB (sum)": 14.0,
        "agent USS MB (private)": 10.0,
    }
    with pytest.raises(RuntimeError, match="no agent process"):
        agent_memory("")


def test_stat_fields_start_with_the_state_and_the_parent() -> None:
    fields = stat_fields(os.getpid())
    assert fields[0] in "RS" and int(fields[1]) == os.getppid()
