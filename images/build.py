"""Build, push and list the images a deployment runs, with the machine's image builder.

Three images, one folder each beside this module (``images/<name>/Dockerfile``):

* ``orchestrator`` -- ``python -m orchard_env.orchestrator`` as uid 10001 on port 8000, Orchard
  installed into a virtual environment (built from this source tree);
* ``agent-injector`` -- the relocatable agent bundle at ``/orchard-agent`` on busybox; its
  entrypoint copies the bundle into the directory given as its argument (a pod's emptyDir);
* ``sandbox`` -- the default sandbox image: Debian plus ``images/sandbox/packages.txt``.

References are ``<registry>/<repository>/<name>:<tag>``; without a registry they are local
(``localhost/...``, never pushed). The tag defaults to ``<version>-<git commit>``. Each build
runs in a temporary context directory (the Dockerfile, its files, and for the first two
images the Orchard source under ``src/``) and is labelled with the OCI version, revision and
source. Pushing to Azure Container Registry first logs the builder in through ACR's token
exchange (an Azure AD token traded for a registry refresh token, passed on stdin).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from orchard_env import __version__
from orchard_env.errors import ConfigError, EngineNotFound, OrchardError, PermissionDenied
from provision.profile import DeploymentProfile, load_profile

Progress = Callable[[str], None]

IMAGES_DIR = Path(__file__).resolve().parent
SOURCE_ROOT = IMAGES_DIR.parent
DEFAULT_REPOSITORY = "orchard"
LOCAL_REGISTRY = "localhost"  # Podman's prefix for images that live only on this machine
BUILDERS = ("docker", "podman", "buildah")
CA_BUNDLE_ID = "ca-bundle"
ACR_SUFFIX = ".azurecr.io"
ACR_USERNAME = "00000000-0000-0000-0000-000000000000"  # what ACR expects with a refresh token
ARM_SCOPE = "https://management.azure.com/.default"
_PROBE_TIMEOUT = 30
_LOG_TAIL = 25


@dataclass(frozen=True)
class ImageSpec:
    name: str
    title: str
    needs_source: bool  # the context gets the Orchard source tree under src/
    by_default: bool = True  # built, pushed and listed when no --only names images


IMAGES: dict[str, ImageSpec] = {
    spec.name: spec
    for spec in (
        ImageSpec("orchestrator", "Orchard orchestrator (the service behind the HTTP API)", True),
        ImageSpec("agent-injector", "Orchard agent bundle, copied into each sandbox pod", True),
        ImageSpec("sandbox", "Orchard default sandbox (Debian, git, bash, python3)", False),
        # Opt-in (--only tools): 1.4 GB, and it holds Claude Code, which is not ours to
        # redistribute (see docs/harnesses.md).
        ImageSpec("tools", "Orchard tools payload (agent harnesses), built here", False, False),
    )
}

# --- references and tags -----------------------------------------------------------------

_HOST = re.compile(
    r"^(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"(?::[0-9]+)?$"
)
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_PLATFORM = re.compile(r"^[a-z0-9]+/[a-z0-9_]+(?:/[a-z0-9]+)?$")


def _check_path(value: str, what: str) -> None:
    parts = value.split("/")
    if not value or not all(_PATH_COMPONENT.match(part) for part in parts):
        raise ConfigError(
            f"{what} {value!r} is not a valid image repository path",
            hint="use lowercase letters, digits and . _ - separated by /, e.g. orchard",
        )


def image_refs(registry: str | None, repository: str, tag: str) -> dict[str, str]:
    """The reference of each image: ``<registry>/<repository>/<name>:<tag>``.

    ``registry`` is a host (``myacr.azurecr.io``, ``localhost:5000``), optionally with a path
    (``ghcr.io/my-org``); ``None`` means local-only references under ``localhost/``.
    """
    registry = (registry or LOCAL_REGISTRY).strip().rstrip("/")
    host, _, prefix = registry.partition("/")
    if not _HOST.match(host):
        raise ConfigError(
            f"registry {registry!r} is not a registry host",
            hint="give a host name, e.g. myacr.azurecr.io or localhost:5000 (no https://)",
        )
    if prefix:
        _check_path(prefix, "registry path")
    _check_path(repository, "repository")
    if not _TAG.match(tag):
        raise ConfigError(
            f"image tag {tag!r} is not valid",
            hint="a tag is 1-128 letters, digits, _ . and -, not starting with . or -",
        )
    return {name: f"{registry}/{repository}/{name}:{tag}" for name in IMAGES}


def registry_of(ref: str) -> str | None:
    """The registry host of a reference, or None when it names none (Docker Hub)."""
    first, slash, _ = ref.partition("/")
    if slash and ("." in first or ":" in first or first == LOCAL_REGISTRY):
        return first
    return None


def is_acr(registry: str) -> bool:
    """Whether a registry host is an Azure Container Registry login server."""
    return registry.lower().endswith(ACR_SUFFIX)


@dataclass(frozen=True)
class SourceInfo:
    """What the images are built from: Orchard's version and the git state of the tree."""

    version: str
    commit: str | None = None  # full sha of HEAD; None outside a git checkout
    short_commit: str | None = None
    dirty: bool = False  # tracked files differ from HEAD
    url: str | None = None  # the origin remote, as an https URL without credentials


def _git(root: Path, *args: str) -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        done = subprocess.run(
            # no index refresh: a status must never hold .git/index.lock under someone's commit
            [git, "--no-optional-locks", "-C", str(root), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=_PROBE_TIMEOUT,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def public_url(remote: str) -> str | None:
    """A git remote as a browsable https URL, credentials and ``.git`` removed (None when it
    is not a network remote)."""
    remote = remote.strip()
    scp = re.match(r"^(?:[^@/]+@)?([^:/]+):(?!//)(.+)$", remote)
    if scp and "://" not in remote:
        host, path = scp.group(1), scp.group(2)
    else:
        parsed = urllib.parse.urlsplit(remote)
        if parsed.scheme not in ("https", "http", "ssh", "git") or not parsed.hostname:
            return None
        host, path = parsed.hostname, parsed.path
    path = path.strip("/").removesuffix(".git")
    return f"https://{host}/{path}" if path else None


def source_info(root: Path = SOURCE_ROOT) -> SourceInfo:
    """Orchard's version, and the commit, dirtiness and origin of the git tree at ``root``."""
    commit = _git(root, "rev-parse", "--verify", "HEAD")
    if not commit:
        return SourceInfo(version=__version__)
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    remote = _git(root, "remote", "get-url", "origin")
    return SourceInfo(
        version=__version__,
        commit=commit,
        short_commit=_git(root, "rev-parse", "--short", "HEAD") or commit[:7],
        dirty=bool(status),
        url=public_url(remote) if remote else None,
    )


def default_tag(info: SourceInfo | None = None) -> str:
    """``<version>-<short commit>``, ``-dirty`` appended when tracked files changed; the
    version alone outside a git checkout. Characters a tag cannot hold become ``-``."""
    info = info or source_info()
    version = re.sub(r"[^A-Za-z0-9_.-]", "-", info.version)
    if info.short_commit is None:
        return version
    return f"{version}-{info.short_commit}" + ("-dirty" if info.dirty else "")


def deployment_refs(profile: DeploymentProfile, registry: str | None, tag: str) -> dict[str, str]:
    """The images a deployment of ``profile`` builds and runs, in ``registry`` under ``tag``:
    the default ones, and the opt-in tools image only with the profile's ``tools: true``."""
    refs = image_refs(registry, profile.registry.repository, tag)
    return select(refs, list(refs) if profile.tools else ())


def registry_for_profile(profile: DeploymentProfile) -> str | None:
    """The registry of a deployment profile: ``registry.server``; for target ``aks`` without
    one, the ACR the provisioning creates (``<acr_name>.azurecr.io``); else none."""
    if profile.registry.server:
        return profile.registry.server
    if profile.target == "aks":
        return f"{profile.acr_name.lower()}{ACR_SUFFIX}"
    return None


def resolve_refs(
    profile_path: Path | None = None,
    *,
    registry: str | None = None,
    tag: str | None = None,
    only: Iterable[str] = (),
) -> dict[str, str]:
    """The references a profile implies (registry, repository, ``image_tag``), overridden by
    ``registry`` and ``tag``, restricted to the ``only`` images if any are named."""
    repository = DEFAULT_REPOSITORY
    if profile_path is not None:
        profile = load_profile(profile_path)
        registry = registry or registry_for_profile(profile)
        repository = profile.registry.repository
        tag = tag or profile.image_tag
    refs = image_refs(registry, repository, tag or default_tag())
    return select(refs, only)


def _check_names(names: Iterable[str]) -> None:
    unknown = [name for name in names if name not in IMAGES]
    if unknown:
        raise ConfigError(
            f"unknown image {', '.join(map(repr, unknown))}",
            hint=f"the images are {', '.join(IMAGES)}",
        )


def select(refs: Mapping[str, str], only: Iterable[str]) -> dict[str, str]:
    """The references of the named images (when none is named: all but the opt-in ones)."""
    names = list(dict.fromkeys(only))
    _check_names(names)
    if not names:
        return {name: ref for name, ref in refs.items() if IMAGES[name].by_default}
    return {name: ref for name, ref in refs.items() if name in names}


# --- builders ------------------------------------------------------------------------------

_PROBES = {
    "docker": ["version", "--format", "{{.Server.Version}}"],  # fails without a daemon
    "podman": ["version", "--format", "{{.Client.Version}}"],
    "buildah": ["version"],
}


def _probe(builder: str) -> str | None:
    """Why ``builder`` cannot build here, or None when it can."""
    path = shutil.which(builder)
    if path is None:
        return "not installed"
    try:
        done = subprocess.run(
            [path, *_PROBES[builder]],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            timeout=_PROBE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return f"`{builder} {' '.join(_PROBES[builder][:1])}` did not answer"
    except OSError as exc:
        return str(exc)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit code {done.returncode}"
    return None


def detect_builder(preferred: str | None = None) -> str:
    """The first of docker, podman and buildah that works here (docker only with a reachable
    daemon), or ``preferred`` alone when given."""
    if preferred is not None and preferred not in BUILDERS:
        raise ConfigError(
            f"unknown image builder {preferred!r}", hint=f"use one of {', '.join(BUILDERS)}"
        )
    problems = []
    for builder in [preferred] if preferred else BUILDERS:
        problem = _probe(builder)
        if problem is None:
            return builder
        problems.append(f"{builder}: {problem}")
    raise EngineNotFound(
        "no image builder works here (" + "; ".join(problems) + ")",
        hint="install Podman (apt-get install podman) or Buildah, or start the Docker daemon",
    )


def _run(
    command: list[str],
    *,
    progress: Progress | None,
    failure: str,
    hint: str,
) -> None:
    """Run a builder command, its output lines to ``progress``; on failure raise with the
    last lines of its output."""
    tail: deque[str] = deque(maxlen=_LOG_TAIL)
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
    except OSError as exc:
        raise EngineNotFound(
            f"cannot run {command[0]}: {exc.strerror or exc}",
            hint="install it, or pick another builder with --builder",
        ) from None
    with process:
        assert process.stdout is not None  # stdout=PIPE above
        for raw in process.stdout:
            line = raw.rstrip()
            if line:
                tail.append(line)
                if progress is not None:
                    progress(line)
    if process.returncode != 0:
        raise OrchardError(f"{failure} (exit {process.returncode}):\n" + "\n".join(tail), hint=hint)


# --- build ---------------------------------------------------------------------------------


def dockerfile(name: str) -> Path:
    return IMAGES_DIR / name / "Dockerfile"


def build_args_of(name: str) -> set[str]:
    """The build arguments an image's Dockerfile declares (``ARG NAME[=default]``)."""
    found = re.findall(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)", dockerfile(name).read_text(), re.M)
    return set(found)


def _check_build_args(names: Iterable[str]) -> None:
    declared = set().union(*(build_args_of(name) for name in IMAGES))
    unknown = sorted(set(names) - declared)
    if unknown:
        raise ConfigError(
            f"no Dockerfile declares the build argument {', '.join(unknown)}",
            hint=f"the Dockerfiles take {', '.join(sorted(declared))}",
        )


def parse_base_images(values: Iterable[str]) -> dict[str, str]:
    """``ARG=IMAGE`` pairs (``BASE_IMAGE=python:3.11-slim``) as a dict, names checked against
    the build arguments the Dockerfiles declare."""
    parsed: dict[str, str] = {}
    for value in values:
        key, sep, image = value.partition("=")
        if not sep or not key or not image:
            raise ConfigError(
                f"base image {value!r} is not ARG=IMAGE",
                hint="e.g. --base-image BASE_IMAGE=python:3.11-slim",
            )
        parsed[key] = image
    _check_build_args(parsed)
    return parsed


def _ignore(folder: str, names: list[str]) -> set[str]:
    return {
        name
        for name in names
        if name in ("__pycache__", "__init__.py") or name.endswith((".pyc", ".egg-info"))
    }


def _copy_source(root: Path, dest: Path) -> None:
    """The files ``pip install`` needs: pyproject.toml, its readme, licence files and the
    top-level package folders its ``[tool.setuptools.packages.find]`` includes."""
    pyproject = root / "pyproject.toml"
    try:
        meta = tomllib.loads(pyproject.read_text())
        include = meta["tool"]["setuptools"]["packages"]["find"]["include"]
        readme = meta["project"].get("readme")
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError):
        raise OrchardError(
            f"the orchestrator and agent-injector images are built from Orchard's source "
            f"tree, and {root} is not one (no usable pyproject.toml)",
            hint="run `orchard images build` from a clone of the repository "
            "(installed with `pip install -e .`)",
        ) from None
    dest.mkdir()
    files = [pyproject, *root.glob("LICEN[CS]E*")]
    if isinstance(readme, str):
        files.append(root / readme)
    for path in files:
        if path.is_file():
            shutil.copy2(path, dest / path.name)
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and any(fnmatch.fnmatch(folder.name, p.rstrip("*")) for p in include):
            shutil.copytree(
                folder,
                dest / folder.name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
            )


def assemble_context(name: str, dest: Path, root: Path = SOURCE_ROOT) -> None:
    """Fill the empty directory ``dest`` with the build context of image ``name``: the files
    of ``images/<name>/`` and, for images built from Orchard itself, its source in ``src/``."""
    shutil.copytree(IMAGES_DIR / name, dest, ignore=_ignore, dirs_exist_ok=True)
    if IMAGES[name].needs_source:
        _copy_source(root, dest / "src")
    if name == "tools":
        _link_or_copy(tools_payload(), dest / "payload")


def tools_payload() -> Path:
    """The payload the service settings name (``tools``, ``tools_versions``), built on this
    machine if it is not cached yet."""
    from orchard_env.config import service_settings
    from orchard_env.tools.payload import ensure_payload

    settings = service_settings()
    if settings.tools_dir is not None:
        return settings.tools_dir
    if not settings.tools:
        raise ConfigError(
            "the tools image needs harnesses, and the tools setting is none",
            hint="set ORCHARD_TOOLS (e.g. all, or codex,pi), or leave the image out with --only",
        )
    return ensure_payload(
        settings.tools, settings.tools_versions, cache_dir=settings.tools_cache_dir
    )


def _link_or_copy(source: Path, dest: Path) -> None:
    """Hard links where ``dest`` is on the payload's filesystem (1.4 GB is not copied)."""
    try:
        shutil.copytree(source, dest, symlinks=True, copy_function=os.link)
    except OSError:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(source, dest, symlinks=True)


def image_labels(name: str, info: SourceInfo) -> dict[str, str]:
    labels = {
        "org.opencontainers.image.title": f"orchard-{name}",
        "org.opencontainers.image.description": IMAGES[name].title,
        "org.opencontainers.image.version": info.version,
    }
    if info.commit:
        labels["org.opencontainers.image.revision"] = info.commit
    if info.url:
        labels["org.opencontainers.image.source"] = info.url
    return labels


def build_command(
    builder: str,
    *,
    ref: str,
    context: Path,
    build_args: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    platform: str | None = None,
    secrets: Mapping[str, Path] | None = None,
) -> list[str]:
    """The command line that builds ``context`` as ``ref`` with ``builder``."""
    command = [builder, "build"]
    if builder == "buildah":
        command.append("--layers")  # cache layers as docker and podman do
    command += ["--file", str(context / "Dockerfile"), "--tag", ref]
    if platform:
        command += ["--platform", platform]
    for key, value in sorted((build_args or {}).items()):
        command += ["--build-arg", f"{key}={value}"]
    for key, value in sorted((labels or {}).items()):
        command += ["--label", f"{key}={value}"]
    for key, path in sorted((secrets or {}).items()):
        command += ["--secret", f"id={key},src={path}"]
    command.append(str(context))
    return command


def build_images(
    refs: Mapping[str, str],
    *,
    builder: str,
    platform: str | None = None,
    base_images: Mapping[str, str] | None = None,
    ca_bundle: Path | None = None,
    progress: Progress | None = None,
    source: Path = SOURCE_ROOT,
) -> list[str]:
    """Build each image of ``refs`` (name -> reference) and return the references built.

    ``base_images`` sets build arguments (``BASE_IMAGE``, ``BUILDER_IMAGE``, ``FINAL_IMAGE``)
    on the images whose Dockerfile declares them. ``ca_bundle`` is a PEM file pip trusts
    while installing (a TLS-intercepting proxy's CA); it is a build secret, not stored in the
    image. ``platform`` is one ``os/arch[/variant]``, passed to the builder.
    """
    _check_names(refs)  # refused before anything is built
    if platform is not None and not _PLATFORM.match(platform):
        raise ConfigError(
            f"platform {platform!r} is not os/arch[/variant]", hint="e.g. linux/amd64"
        )
    base_images = dict(base_images or {})
    _check_build_args(base_images)
    secrets: dict[str, Path] = {}
    if ca_bundle is not None:
        if not ca_bundle.is_file():
            raise ConfigError(f"CA bundle {ca_bundle} is not a file")
        secrets[CA_BUNDLE_ID] = ca_bundle.resolve()
    info = source_info(source)
    built = []
    for name, ref in refs.items():
        declared = build_args_of(name)
        with tempfile.TemporaryDirectory(prefix=f"orchard-image-{name}-") as folder:
            context = Path(folder) / "context"
            assemble_context(name, context, source)
            command = build_command(
                builder,
                ref=ref,
                context=context,
                build_args={k: v for k, v in base_images.items() if k in declared},
                labels=image_labels(name, info),
                platform=platform,
                secrets=secrets,
            )
            if progress is not None:
                progress(f"building {ref}")
            started = time.monotonic()
            _run(
                command,
                progress=progress,
                failure=f"{builder} could not build {ref}",
                hint="the lines above are the end of the build log; a base image that "
                "cannot be pulled can be replaced with --base-image ARG=IMAGE",
            )
        if progress is not None:
            progress(f"built {ref} in {time.monotonic() - started:.1f}s")
        built.append(ref)
    return built


# --- push and registry login ---------------------------------------------------------------


class AccessToken(Protocol):
    @property
    def token(self) -> str: ...


class TokenCredential(Protocol):
    """What azure-identity's credentials offer (``DefaultAzureCredential``)."""

    def get_token(self, *scopes: str) -> AccessToken: ...


def default_azure_credential() -> TokenCredential:
    """azure-identity's DefaultAzureCredential (the azure extra), imported only when needed."""
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        raise OrchardError(
            "logging in to Azure Container Registry needs azure-identity",
            hint="install the azure extra: pip install 'orchard[azure]'",
        ) from None
    credential: TokenCredential = DefaultAzureCredential()
    return credential


def _azure_auth_errors() -> tuple[type[Exception], ...]:
    try:
        from azure.core.exceptions import ClientAuthenticationError
    except ImportError:
        return ()
    return (ClientAuthenticationError,)


def _tenant_of(token: str) -> str | None:
    """The ``tid`` claim of a JWT access token (not verified: ACR verifies it)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (binascii.Error, ValueError):
        return None
    tenant = claims.get("tid") if isinstance(claims, dict) else None
    return tenant if isinstance(tenant, str) and tenant else None


def exchange_acr_token(
    login_server: str, aad_token: str, *, transport: httpx.BaseTransport | None = None
) -> str:
    """Trade an Azure AD access token for an ACR refresh token (what ``az acr login`` does):
    ``POST https://<login_server>/oauth2/exchange``, form-encoded."""
    form = {"grant_type": "access_token", "service": login_server, "access_token": aad_token}
    tenant = _tenant_of(aad_token)
    if tenant:
        form["tenant"] = tenant
    url = f"https://{login_server}/oauth2/exchange"
    try:
        with httpx.Client(transport=transport, timeout=30) as client:
            response = client.post(url, data=form)
    except httpx.HTTPError as exc:
        raise OrchardError(
            f"cannot reach {login_server} for the ACR token exchange: {exc}",
            hint="check the registry name (<name>.azurecr.io) and the network",
        ) from None
    if response.status_code != 200:
        detail = response.text.strip()[:300] or response.reason_phrase
        error = PermissionDenied if response.status_code in (401, 403) else OrchardError
        raise error(
            f"{login_server} refused the ACR token exchange (HTTP {response.status_code}): "
            f"{detail}",
            hint="your Azure identity needs the AcrPush role on the registry; `az login` "
            "switches accounts",
        )
    try:
        refresh = response.json().get("refresh_token")
    except (ValueError, AttributeError):
        refresh = None
    if not isinstance(refresh, str) or not refresh:
        raise OrchardError(f"{login_server} answered the ACR token exchange without a token")
    return refresh


def registry_login(builder: str, server: str, username: str, password: str) -> None:
    """``<builder> login <server> -u <username> --password-stdin``, the password on stdin."""
    try:
        done = subprocess.run(
            [builder, "login", server, "-u", username, "--password-stdin"],
            input=password + "\n",
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OrchardError(f"{builder} login {server} failed: {exc}") from None
    if done.returncode != 0:
        message = (done.stderr or done.stdout).strip()
        raise OrchardError(
            f"{builder} login {server} failed (exit {done.returncode}): {message}",
            hint="check that the registry exists and that you may push to it",
        )


def acr_login(
    login_server: str,
    credential: TokenCredential | None,
    builder: str,
    *,
    transport: httpx.BaseTransport | None = None,
) -> None:
    """Log ``builder`` in to an Azure Container Registry with an Azure AD identity (default:
    DefaultAzureCredential), through ACR's token exchange."""
    credential = credential or default_azure_credential()
    try:
        aad_token = credential.get_token(ARM_SCOPE).token
    except _azure_auth_errors():
        raise OrchardError(
            "no Azure credential is available to log in to " + login_server,
            hint="run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and AZURE_CLIENT_SECRET",
        ) from None
    refresh = exchange_acr_token(login_server, aad_token, transport=transport)
    registry_login(builder, login_server, ACR_USERNAME, refresh)


def push_images(
    refs: Mapping[str, str],
    *,
    builder: str,
    progress: Progress | None = None,
    login: bool = True,
    credential: TokenCredential | None = None,
    transport: httpx.BaseTransport | None = None,
    plain_http: bool = False,
) -> list[str]:
    """Push each reference; first log in to every Azure Container Registry among them
    (unless ``login`` is false: the builder is logged in already). Returns what was pushed.
    ``plain_http``: the registry has no TLS (Podman and Buildah are told; Docker's daemon
    decides by its ``insecure-registries``)."""
    registries = []
    for ref in refs.values():
        registry = registry_of(ref)
        if registry is None or registry == LOCAL_REGISTRY:
            raise ConfigError(
                f"{ref} names no registry to push to",
                hint="pass --registry (e.g. myacr.azurecr.io) or set registry.server in "
                "the profile",
            )
        registries.append(registry)
    if login:
        for server in sorted({r for r in registries if is_acr(r)}):
            if progress is not None:
                progress(f"logging in to {server} (ACR token exchange)")
            acr_login(server, credential, builder, transport=transport)
    pushed = []
    insecure = ["--tls-verify=false"] if plain_http and builder != "docker" else []
    for ref in refs.values():
        if progress is not None:
            progress(f"pushing {ref}")
        _run(
            [builder, "push", *insecure, ref],
            progress=progress,
            failure=f"{builder} could not push {ref}",
            hint="build it first (`orchard images build`) and check that you may push to "
            "the registry",
        )
        pushed.append(ref)
    return pushed


# --- list ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageStatus:
    name: str
    ref: str
    present: bool  # the builder's local storage has it


def image_exists(ref: str, builder: str) -> bool:
    """Whether ``builder``'s local storage holds ``ref``."""
    if builder == "buildah":
        command = [builder, "inspect", "--type", "image", ref]
    else:
        command = [builder, "image", "inspect", ref]
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
            timeout=_PROBE_TIMEOUT,
        )
        return done.returncode == 0
    return False


def list_images(refs: Mapping[str, str], *, builder: str) -> list[ImageStatus]:
    """Each image of ``refs`` and whether it exists locally."""
    return [ImageStatus(name, ref, image_exists(ref, builder)) for name, ref in refs.items()]
