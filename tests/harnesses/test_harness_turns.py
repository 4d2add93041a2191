"""The five real harnesses, each for one complete tool-using turn, in ``--network none``
sandboxes (engine tier): the tools payload on PATH, the model gateway at 127.0.0.1:4000 and
the scripted fake model (:mod:`orchard_env.fake_model`) behind it (it asks to run
``echo hi > out.txt``, then answers). Each harness runs with no flags about endpoints; the
test checks the file it made and the calls the gateway recorded for its trajectory."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import httpx
import pytest

from orchard_env.config import ServiceSettings, service_settings
from orchard_env.fake_model import FakeModel, running
from tests.conftest import remove_sandboxes
from tests.servers import live_service

pytestmark = pytest.mark.engine

PROMPT = "Create out.txt holding hi, using your shell tool."
# Each harness's ordinary headless command line: nothing in it says where the model is.
COMMANDS = {
    "codex": "codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "
    f"{shlex.quote(PROMPT)} </dev/null",
    "claude": f"claude -p {shlex.quote(PROMPT)} --dangerously-skip-permissions",
    "opencode": f"opencode run {shlex.quote(PROMPT)}",
    "pi": f"pi -p --no-session {shlex.quote(PROMPT)}",
    "hermes": f"hermes -z {shlex.quote(PROMPT)} --yolo",
}


@pytest.fixture(scope="module")
def model() -> Iterator[FakeModel]:
    with running() as fake:
        yield fake


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory,
    engine_instance: str,
    agent_bundle: Path,
    tools_payload: Path,
    model: FakeModel,
) -> Iterator[ServiceSettings]:
    state = tmp_path_factory.mktemp("harness")
    endpoints = state / "endpoints.toml"
    endpoints.write_text(
        'default_openai = "fake"\ndefault_anthropic = "fake-anthropic"\n'
        f'[endpoints.fake]\napi = "openai"\nbase_url = "{model.url}/v1"\n'
        'key_env = "ORCHARD_TEST_MODEL_KEY"\nmodel = "fake-model"\n'
        f'[endpoints.fake-anthropic]\napi = "anthropic"\nbase_url = "{model.url}"\n'
        'key_env = "ORCHARD_TEST_MODEL_KEY"\n'
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ORCHARD_TEST_MODEL_KEY", model.key)
        yield service_settings(
            state_dir=state,
            instance=f"{engine_instance}-harness",
            agent_bundle_dir=agent_bundle,
            tools_dir=tools_payload,
            model_endpoints_file=endpoints,
        )


@pytest.fixture(scope="module")
def http(settings: ServiceSettings, docker_client: docker.DockerClient) -> Iterator[httpx.Client]:
    with (
        live_service(settings, key_name="harnesses") as live,
        httpx.Client(base_url=live.url, headers={"X-API-Key": live.api_key}, timeout=300) as c,
    ):
        yield c
    remove_sandboxes(docker_client, settings.instance)


@pytest.fixture(scope="module", params=["debian", "busybox"])
def sandbox(request: pytest.FixtureRequest, http: httpx.Client) -> str:
    image = request.getfixturevalue(f"{request.param.replace('debian', 'sandbox')}_image")
    created = http.post("/sandboxes", json={"image": image, "model_gateway": {}})
    assert created.status_code == 201, created.text
    sandbox_id: str = created.json()["sandbox_id"]
    ready = http.get(f"/sandboxes/{sandbox_id}/wait", params={"timeout": 120})
    assert ready.json()["status"] == "ready", ready.text
    return sandbox_id


@pytest.mark.parametrize("harness", list(COMMANDS))
def test_a_harness_completes_a_tool_using_turn_through_the_gateway(
    http: httpx.Client, sandbox: str, harness: str, model: FakeModel
) -> None:
    trajectory = f"turn-{harness}"
    put = http.put(f"/sandboxes/{sandbox}/trajectory", json={"trajectory_id": trajectory})
    assert put.status_code == 200, put.text
    workdir = f"/tmp/turn-{harness}"
    command = f"mkdir -p {workdir} && cd {workdir} && {COMMANDS[harness]}"
    ran = http.post(
        f"/sandboxes/{sandbox}/exec",
        json={"command": command, "wait": True, "timeout_seconds": 240},
    )
    assert ran.status_code == 200, ran.text
    job = ran.json()
    assert job["exit_code"] == 0, job
    made = http.post(
        f"/sandboxes/{sandbox}/exec", json={"command": f"cat {workdir}/out.txt", "wait": True}
    )
    assert made.json()["stdout"] == "hi\n", (made.json(), job)

    listed = http.get(f"/sandboxes/{sandbox}/model-calls", params={"trajectory_id": trajectory})
    calls = listed.json()["calls"]
    answered = [c for c in calls if c.get("status") == 200 and c.get("kind") == "main"]
    # The tool call, then the answer after the command's output came back.
    assert len(answered) >= 2, calls
    assert [c["seq"] for c in calls] == list(range(1, len(calls) + 1))
    assert all(model.key not in str(c["request"]) for c in calls)


def test_a_fork_at_a_turn_keeps_the_gateway_tools_and_trajectory(
    http: httpx.Client, sandbox_image: str
) -> None:
    """The RL branching step: run a turn, fork, and each fork's harness calls go through its
    own gateway (same endpoints, the trajectory it was at), with the source's harness choice."""
    gateway = {"trajectory_id": "episode-1", "max_calls": 50}
    body = {"image": sandbox_image, "model_gateway": gateway, "tools": ["pi"]}
    created = http.post("/sandboxes", json=body)
    assert created.status_code == 201, created.text
    source = created.json()["sandbox_id"]
    assert http.get(f"/sandboxes/{source}/wait", params={"timeout": 120}).json()["ready"]
    first = f"mkdir -p /tmp/ep && cd /tmp/ep && {COMMANDS['pi']}"
    assert run_ok(http, source, first)["exit_code"] == 0

    forked = http.post(f"/sandboxes/{source}/fork", json={"count": 2})
    assert forked.status_code == 201, forked.text
    forks = [info["sandbox_id"] for info in forked.json()["sandboxes"]]
    assert len(forks) == 2
    for fork in forks:
        info = http.get(f"/sandboxes/{fork}").json()
        assert info["model_gateway"]["trajectory_id"] == "episode-1", info
        assert info["tools"] == ["pi"], info
        which = run_ok(http, fork, "command -v pi; command -v codex || echo no-codex")
        assert which["stdout"].split() == ["/opt/sandbox-tools/bin/pi", "no-codex"], which
        again = f"cd /tmp/ep && rm out.txt && {COMMANDS['pi']} && cat out.txt"
        assert run_ok(http, fork, again)["stdout"].endswith("hi\n")
        calls = http.get(f"/sandboxes/{fork}/model-calls").json()["calls"]
        assert {c["trajectory_id"] for c in calls} == {"episode-1"}
        assert [c["seq"] for c in calls] == list(range(1, len(calls) + 1)) and len(calls) >= 2


def run_ok(http: httpx.Client, sandbox_id: str, command: str) -> dict[str, object]:
    ran = http.post(
        f"/sandboxes/{sandbox_id}/exec",
        json={"command": command, "wait": True, "timeout_seconds": 240},
    )
    assert ran.status_code == 200, ran.text
    job: dict[str, object] = ran.json()
    assert job["exit_code"] == 0, job
    return job
