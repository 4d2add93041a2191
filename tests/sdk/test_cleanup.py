"""Created sandboxes are deleted: on close, on leaving ``with``, at exit and on signals."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import httpx
import pytest

from orchard_env.sdk import SandboxClient, _cleanup
from tests.sdk.conftest import FakeTime
from tests.sdk.fakes import FakeService


def _deleted(service: FakeService) -> set[str]:
    return {r.url.path.rsplit("/", 1)[1] for r in service.requests if r.method == "DELETE"}


def test_close_deletes_what_the_client_created(service: FakeService, fake_time: FakeTime) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport())
    made = {client.create_sandbox("python:3.11-slim").sandbox_id for _ in range(3)}
    service.sandboxes["not-ours"] = {
        **service.sandboxes[next(iter(made))],
        "sandbox_id": "not-ours",
    }
    client.get_sandbox("not-ours")  # fetched, not created: not ours to delete
    assert {sid for ids in _cleanup.pending().values() for sid in ids} == made
    client.close()
    assert _deleted(service) == made
    assert list(service.sandboxes) == ["not-ours"]
    assert _cleanup.pending() == {}
    client.close()  # idempotent
    assert client.is_closed


def test_with_blocks_delete(service: FakeService) -> None:
    with SandboxClient(base_url="http://t", transport=service.transport()) as client:
        with client.create_sandbox("python:3.11-slim") as sandbox:
            sandbox_id = sandbox.sandbox_id
        assert _deleted(service) == {sandbox_id}
        kept = client.create_sandbox("python:3.11-slim").sandbox_id
    assert _deleted(service) == {sandbox_id, kept}
    assert service.sandboxes == {}


def test_a_failing_with_body_is_not_hidden_by_a_failing_delete(
    client: SandboxClient, service: FakeService, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response | None:
        return httpx.Response(500, json={"detail": "nope"}) if request.method == "DELETE" else None

    sandbox = client.create_sandbox("python:3.11-slim")
    with pytest.raises(ValueError, match="the real problem"), sandbox:
        service.interceptors.append(refuse)
        raise ValueError("the real problem")
    assert f"could not delete sandbox {sandbox.sandbox_id}: nope" in caplog.text
    service.interceptors.remove(refuse)


def test_auto_cleanup_off_keeps_sandboxes(service: FakeService) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport(), auto_cleanup=False)
    sandbox_id = client.create_sandbox("python:3.11-slim").sandbox_id
    assert _cleanup.pending() == {}
    client.close()
    assert service.sandboxes.keys() == {sandbox_id}


def test_cleanup_all_deletes_even_without_auto_cleanup(service: FakeService) -> None:
    with SandboxClient(base_url="http://t", transport=service.transport(), auto_cleanup=False) as c:
        ids = {c.create_sandbox("python:3.11-slim").sandbox_id for _ in range(2)}
        assert set(c.cleanup_all()) == ids
        assert c.cleanup_all() == []
    assert service.sandboxes == {}


def test_exit_cleanup_deletes_leftovers_of_open_clients(service: FakeService) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport())
    left = {client.create_sandbox("python:3.11-slim").sandbox_id for _ in range(2)}
    _cleanup.cleanup_pending()
    assert _deleted(service) == left and service.sandboxes == {}
    assert _cleanup.pending() == {}
    client.close()


def test_exit_cleanup_logs_failures(service: FakeService, caplog: pytest.LogCaptureFixture) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport())
    sandbox_id = client.create_sandbox("python:3.11-slim").sandbox_id
    service.interceptors.append(
        lambda r: httpx.Response(500, text="engine down") if r.method == "DELETE" else None
    )
    with caplog.at_level(logging.WARNING, logger="orchard_env.sdk"):
        _cleanup.cleanup_pending()
    assert f"could not delete sandbox {sandbox_id} at http://t: HTTP 500 engine down" in caplog.text
    client._core.untrack(sandbox_id)
    client.close()


def test_signal_handler_cleans_up_then_chains(
    service: FakeService, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport())
    sandbox_id = client.create_sandbox("python:3.11-slim").sandbox_id
    calls: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        calls.append(signum)
        assert sandbox_id not in service.sandboxes, "the previous handler ran before cleanup"

    _cleanup._chained(signal.SIGTERM, previous)(signal.SIGTERM, None)
    assert calls == [signal.SIGTERM]
    client.close()


def test_signal_handler_restores_the_default_action(monkeypatch: pytest.MonkeyPatch) -> None:
    actions: list[tuple[str, object]] = []
    monkeypatch.setattr(signal, "signal", lambda s, h: actions.append(("set", h)))
    monkeypatch.setattr(signal, "raise_signal", lambda s: actions.append(("raise", s)))
    _cleanup._chained(signal.SIGTERM, signal.SIG_DFL)(signal.SIGTERM, None)
    assert actions == [("set", signal.SIG_DFL), ("raise", signal.SIGTERM)]
    actions.clear()
    _cleanup._chained(signal.SIGTERM, signal.SIG_IGN)(signal.SIGTERM, None)
    assert actions == []


def test_signal_handlers_install_once_from_the_main_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed: list[int] = []
    monkeypatch.setattr(_cleanup, "_signals_installed", False)
    monkeypatch.setattr(signal, "signal", lambda s, h: installed.append(s))
    worker = threading.Thread(target=_cleanup._install)
    worker.start()
    worker.join()
    assert installed == []
    _cleanup._install()
    _cleanup._install()
    assert installed == [signal.SIGINT, signal.SIGTERM]


def test_heartbeat_thread_beats_and_stops_on_close(service: FakeService) -> None:
    client = SandboxClient(base_url="http://t", transport=service.transport())
    sandbox = client.create_sandbox("python:3.11-slim")
    sandbox.start_heartbeat(interval=0.01)
    path = f"/sandboxes/{sandbox.sandbox_id}/heartbeat"
    _poll(lambda: len(service.seen("POST", path)) >= 2)
    thread = sandbox._heartbeat_thread
    assert thread is not None
    client.close()
    assert not thread.is_alive() and sandbox._heartbeat_thread is None


def test_heartbeat_stops_when_the_sandbox_is_gone(
    client: SandboxClient, service: FakeService
) -> None:
    sandbox = client.create_sandbox("python:3.11-slim")
    del service.sandboxes[sandbox.sandbox_id]
    sandbox.start_heartbeat(interval=0.01)
    thread = sandbox._heartbeat_thread
    assert thread is not None
    thread.join(timeout=5)
    assert not thread.is_alive()
    client._core.untrack(sandbox.sandbox_id)


def _poll(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
