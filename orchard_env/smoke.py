"""`orchard smoke`: an end-to-end check of a running Orchard service that fails loudly.

Each check runs against a real sandbox through the public API and records pass/fail,
duration and what was wrong. The sandbox is deleted whatever happens. The API key is never
part of any message.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree as ET

from orchard_env.errors import OrchardError, SandboxNotFound
from orchard_env.sdk import Sandbox, SandboxClient

DEFAULT_IMAGE = "localhost/orchard/sandbox:latest"
SMOKE_LABEL = "orchard-smoke"

_PATCH_BASE = "line one\nline two\n"
_PATCH = """\
--- a/smoke.txt
+++ b/smoke.txt
@@ -1,2 +1,2 @@
 line one
-line two
+line two, patched
"""
# A UDP connect() sends no packet: it only asks the kernel for a route. With no network
# interface it fails at once with "Network is unreachable"; nothing leaves the machine.
_EGRESS_PROBE = (
    "import socket\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "try:\n"
    "    s.connect(('192.0.2.1', 9))\n"
    "    print('ROUTED')\n"
    "except OSError as e:\n"
    "    print('BLOCKED', e.errno)\n"
)
# A pod always has a network interface; on Kubernetes a sandbox's egress is cut by a
# NetworkPolicy instead. Every pod is given the API server's Service address, which any pod
# reaches unless a policy denies it: the one connection tried, and it stays in the cluster.
_POD_EGRESS_PROBE = (
    "import os, socket\n"
    "host = os.environ.get('KUBERNETES_SERVICE_HOST')\n"
    "port = int(os.environ.get('KUBERNETES_SERVICE_PORT') or 443)\n"
    "if not host:\n"
    "    print('NO-ADDRESS')\n"
    "else:\n"
    "    try:\n"
    "        socket.create_connection((host, port), timeout=5).close()\n"
    "        print('REACHED', f'{host}:{port}')\n"
    "    except OSError as e:\n"
    "        print('BLOCKED', e)\n"
)


class CheckFailed(AssertionError):
    pass


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    message: str = ""


@dataclass
class SmokeReport:
    url: str
    image: str
    steps: list[Step] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    @property
    def failed(self) -> list[Step]:
        return [step for step in self.steps if not step.ok]

    @property
    def seconds(self) -> float:
        return sum(step.seconds for step in self.steps)

    def junit_xml(self) -> str:
        suite = ET.Element(
            "testsuite",
            name="orchard-smoke",
            tests=str(len(self.steps)),
            failures=str(len(self.failed)),
            time=f"{self.seconds:.3f}",
        )
        for step in self.steps:
            case = ET.SubElement(
                suite,
                "testcase",
                classname="orchard.smoke",
                name=step.name,
                time=f"{step.seconds:.3f}",
            )
            if not step.ok:
                ET.SubElement(case, "failure", message=step.message).text = step.message
        ET.indent(suite)
        return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


class _Run:
    def __init__(self, report: SmokeReport, on_step: Callable[[Step], None] | None) -> None:
        self.report = report
        self.on_step = on_step

    def check(self, name: str, body: Callable[[], None]) -> bool:
        started = time.perf_counter()
        try:
            body()
        except (CheckFailed, OrchardError) as exc:
            step = Step(name, False, time.perf_counter() - started, str(exc) or type(exc).__name__)
        else:
            step = Step(name, True, time.perf_counter() - started)
        self.report.steps.append(step)
        if self.on_step:
            self.on_step(step)
        return step.ok


def run_smoke(
    client: SandboxClient,
    *,
    image: str = DEFAULT_IMAGE,
    on_step: Callable[[Step], None] | None = None,
) -> SmokeReport:
    """Run every check; never raises for a failed check (see :attr:`SmokeReport.ok`)."""
    report = SmokeReport(url=client.base_url, image=image)
    run = _Run(report, on_step)
    holder: list[Sandbox] = []

    def health() -> None:
        status = client.health()
        _expect(status.status == "healthy", f"service reports {status.status!r}")

    def create() -> None:
        holder.append(
            client.create_sandbox(
                image, block_network=True, memory="256Mi", cpu=1, labels={SMOKE_LABEL: "true"}
            )
        )

    if not (run.check("health", health) and run.check("create", create)):
        return report
    sandbox = holder[0]
    try:
        _sandbox_checks(run, sandbox)
    finally:
        run.check("delete", lambda: _delete(client, sandbox))
    return report


def _sandbox_checks(run: _Run, sb: Sandbox) -> None:
    def stdout_stderr_exit() -> None:
        result = sb.exec("echo out; echo err >&2; exit 3")
        _expect(result.stdout == "out\n", f"stdout was {result.stdout!r}, expected 'out\\n'")
        _expect(result.stderr == "err\n", f"stderr was {result.stderr!r}, expected 'err\\n'")
        _expect(result.exit_code == 3, f"exit code was {result.exit_code}, expected 3")
        argv = sb.exec(["printf", "%s|", "a b", "c"], shell=False)
        _expect(argv.stdout == "a b|c|", f"argv exec printed {argv.stdout!r}, expected 'a b|c|'")

    def env_and_cwd() -> None:
        result = sb.exec("echo $SMOKE_VAR; pwd", env={"SMOKE_VAR": "orchard"}, cwd="/usr")
        _expect(result.stdout == "orchard\n/usr\n", f"env/cwd gave {result.stdout!r}")
        missing = sb.exec("true", cwd="/does/not/exist")
        _expect(missing.exit_code != 0 and bool(missing.error), "a missing cwd was not an error")

    def timeout() -> None:
        started = time.monotonic()
        result = sb.exec("sleep 30", timeout=1)
        _expect(
            result.timed_out,
            f"sleep 30 with a 1 s timeout was not reported as timed out ({result.status})",
        )
        _expect(time.monotonic() - started < 15, "the timeout took longer than 15 s to fire")
        plain = sb.exec("exit 124")
        _expect(not plain.timed_out and plain.exit_code == 124, "exit 124 was taken for a timeout")

    def binary_round_trip() -> None:
        payload = os.urandom(1024 * 1024) + bytes(range(256))
        sb.upload_content(payload, "/workspace/smoke.bin")
        back = sb.download_content("/workspace/smoke.bin")
        _expect(
            back == payload, f"downloaded {len(back)} bytes differ from the {len(payload)} uploaded"
        )

    def patch() -> None:
        sb.upload_content(_PATCH_BASE, "/workspace/smoke.txt")
        result = sb.apply_patch(_PATCH)
        _expect(result.success, f"git apply failed: {result.error or result.stderr}")
        text = sb.download_content("/workspace/smoke.txt").decode()
        _expect(text == "line one\nline two, patched\n", f"patched file reads {text!r}")

    def egress_blocked() -> None:
        interfaces = sb.exec("ls /sys/class/net").stdout.split()
        if interfaces == ["lo"]:  # no network at all (the container engine)
            probe = sb.exec(["python3", "-c", _EGRESS_PROBE], shell=False)
            _expect(
                probe.stdout.startswith("BLOCKED"), f"an outbound route exists: {probe.stdout!r}"
            )
            return
        # A pod: its interface stays, and a NetworkPolicy must refuse what leaves it.
        probe = sb.exec(["python3", "-c", _POD_EGRESS_PROBE], shell=False, timeout=30)
        _expect(
            not probe.stdout.startswith("NO-ADDRESS"),
            f"network interfaces present ({', '.join(interfaces)}) outside Kubernetes",
        )
        _expect(
            probe.stdout.startswith("BLOCKED"),
            f"the sandbox reached the Kubernetes API server: {probe.stdout.strip()!r}",
        )

    def memory_limit() -> None:
        result = sb.exec(
            ["python3", "-c", "b = bytearray(512 * 1024 * 1024); print(len(b))"],
            timeout=60,
            shell=False,
        )
        _expect(
            result.exit_code != 0 and "536870912" not in result.stdout,
            "allocating 512 MiB in a 256 MiB sandbox succeeded: the memory limit is not applied",
        )
        alive = sb.exec("echo alive")
        _expect(alive.stdout == "alive\n", "the sandbox did not survive its command's OOM kill")

    for name, body in (
        ("exec: stdout, stderr, exit code, argv", stdout_stderr_exit),
        ("exec: env and cwd", env_and_cwd),
        ("exec: timeout", timeout),
        ("files: binary round trip", binary_round_trip),
        ("patch", patch),
        ("isolation: egress blocked", egress_blocked),
        ("limits: memory", memory_limit),
    ):
        run.check(name, body)


def _delete(client: SandboxClient, sb: Sandbox) -> None:
    sb.delete()
    try:
        info = client.get_sandbox(sb.sandbox_id).info
    except SandboxNotFound:
        return
    _expect(info.status == "deleted", f"after delete the sandbox is {info.status!r}")
    leftovers = [
        s.sandbox_id
        for s in client.list_sandboxes(labels={SMOKE_LABEL: "true"})
        if s.sandbox_id == sb.sandbox_id
    ]
    _expect(not leftovers, f"sandbox {sb.sandbox_id} is still listed after delete")


def write_junit(report: SmokeReport, path: Path) -> None:
    path.write_text(report.junit_xml())
