"""A stateful fake of Azure Resource Manager at the HTTP layer, for the real Azure SDK clients.

:class:`FakeArm` answers the requests the SDKs send through their default transport
(requests), intercepted with ``responses``: resource groups, resource providers, Log Analytics
workspaces, container registries (and their name check), AKS clusters and agent pools, the
cluster's user credentials, and role assignments. Writes of resources are long-running
operations the way ARM does them: ``201``/``202`` with an ``Azure-AsyncOperation`` header
whose operation answers ``InProgress`` and then ``Succeeded``, after which the SDK reads the
resource. Errors carry ARM's ``{"error": {"code", "message"}}`` body.

Tests queue failures for role assignment writes (:attr:`FakeArm.role_failures`) and read what
was sent from :attr:`FakeArm.requests` (method, path, JSON body).
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

import responses
import yaml
from azure.core.credentials import AccessToken, AccessTokenInfo
from azure.core.exceptions import ClientAuthenticationError

ARM = "https://management.azure.com"
SUBSCRIPTION = "00000000-1111-2222-3333-444444444444"
KUBELET_OBJECT_ID = "aaaaaaaa-0000-0000-0000-000000000001"
CLIENT_OPTIONS = {"polling_interval": 0, "retry_total": 0}

_RG = re.compile(r"^/subscriptions/[^/]+/resourcegroups/(?P<rg>[^/]+)$", re.I)
_IN_RG = re.compile(r"^/subscriptions/[^/]+/resourcegroups/(?P<rg>[^/]+)/providers/", re.I)
_PROVIDER = re.compile(r"^/subscriptions/[^/]+/providers/(?P<ns>[^/]+)(?P<register>/register)?$")
_ROLE = re.compile(
    r"^(?P<scope>.+)/providers/Microsoft\.Authorization/roleAssignments(?:/(?P<name>[^/]+))?$",
    re.I,
)


class FakeCredential:
    """A TokenCredential that always has a token (no network)."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken("fake-arm-token", int(time.time()) + 3600)

    def get_token_info(self, *scopes: str, options: Any = None) -> AccessTokenInfo:
        return AccessTokenInfo("fake-arm-token", int(time.time()) + 3600)


class NoCredential:
    """What DefaultAzureCredential does on a machine without `az login` or variables."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        raise ClientAuthenticationError(
            "DefaultAzureCredential failed to retrieve a token from the included credentials.\n"
            "Attempted credentials:\n\tEnvironmentCredential: EnvironmentCredential "
            "authentication unavailable. Environment variables are not fully configured."
        )


@dataclass(frozen=True)
class Sent:
    method: str
    path: str
    body: Any


def user_kubeconfig(cluster: str) -> bytes:
    """What listClusterUserCredential returns (decoded): one cluster, user and context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster,
                "cluster": {
                    "server": f"https://{cluster}-dns.hcp.eastus.azmk8s.io:443",
                    "certificate-authority-data": "Q0E=",
                },
            }
        ],
        "users": [{"name": f"clusterUser_rg_{cluster}", "user": {"token": "user-token"}}],
        "contexts": [
            {"name": cluster, "context": {"cluster": cluster, "user": f"clusterUser_rg_{cluster}"}}
        ],
        "current-context": cluster,
    }
    return yaml.safe_dump(config).encode()


@dataclass
class FakeArm:
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)  # by lowercase path
    providers: dict[str, str] = field(
        default_factory=dict
    )  # namespace -> state (default Registered)
    role_assignments: dict[str, dict[str, Any]] = field(default_factory=dict)
    role_failures: list[tuple[int, str]] = field(default_factory=list)
    taken_registry_names: set[str] = field(default_factory=set)
    requests: list[Sent] = field(default_factory=list)
    operation_polls: dict[str, int] = field(default_factory=dict)  # op id -> GETs served
    _operations: dict[str, list[str]] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    # --- test helpers ----------------------------------------------------------------------

    def install(self, mock: responses.RequestsMock) -> None:
        pattern = re.compile(re.escape(ARM) + r"/.*")
        for method in (responses.GET, responses.PUT, responses.POST, responses.DELETE):
            mock.add_callback(method, pattern, callback=self._callback)

    def sent(self, method: str | None = None) -> list[Sent]:
        return [r for r in self.requests if method is None or r.method == method]

    def writes(self) -> list[str]:
        """``METHOD path`` of every request that changes something."""
        return [
            f"{r.method} {r.path}"
            for r in self.requests
            if r.method in ("PUT", "DELETE")
            or (r.method == "POST" and r.path.lower().endswith("/register"))
        ]

    def add(self, path: str, body: dict[str, Any]) -> None:
        """Make a resource exist (as if created outside Orchard)."""
        self._store(path, copy.deepcopy(body))

    def get(self, path: str) -> dict[str, Any] | None:
        return self.resources.get(path.lower())

    # --- the API -----------------------------------------------------------------------------

    def _callback(self, request: Any) -> tuple[int, dict[str, str], str]:
        split = urlsplit(request.url)
        path = split.path
        query = parse_qs(split.query)
        body = json.loads(request.body) if request.body else None
        self.requests.append(Sent(request.method, path, body))
        if request.headers.get("Authorization") != "Bearer fake-arm-token":
            return _error(401, "AuthenticationFailed", "no bearer token")
        status, headers, answer = self._route(request.method, path, query, body)
        text = "" if answer is None else json.dumps(answer)
        return status, {"Content-Type": "application/json", **headers}, text

    def _route(
        self, method: str, path: str, query: dict[str, list[str]], body: Any
    ) -> tuple[int, dict[str, str], Any]:
        if path.startswith("/fake-operations/"):
            return self._operation(path.rsplit("/", 1)[1])
        role = _ROLE.match(path)
        if role:
            return self._role(method, role["scope"], role["name"], query, body)
        provider = _PROVIDER.match(path)
        if provider:
            return self._provider(provider["ns"], register=bool(provider["register"]))
        lower = path.lower()
        if lower.endswith("/providers/microsoft.containerregistry/checknameavailability"):
            name = body["name"]
            free = name not in self.taken_registry_names
            return 200, {}, {"nameAvailable": free, **({} if free else {"reason": "AlreadyExists"})}
        if lower.endswith("/listclusterusercredential"):
            cluster = path.split("/")[-2]
            value = base64.b64encode(user_kubeconfig(cluster)).decode()
            return 200, {}, {"kubeconfigs": [{"name": "clusterUser", "value": value}]}
        if method == "GET":
            found = self.resources.get(lower)
            if found is None:
                code = "ResourceGroupNotFound" if _RG.match(path) else "ResourceNotFound"
                return _error(404, code, f"{path} was not found")
            return 200, {}, copy.deepcopy(found)
        if method == "PUT":
            return self._put(path, body)
        if method == "DELETE":
            return self._delete(path)
        return _error(405, "MethodNotAllowed", f"{method} {path}")

    def _lro(self) -> tuple[str, dict[str, str]]:
        op = f"op-{next(self._ids)}"
        self._operations[op] = ["InProgress", "Succeeded"]
        self.operation_polls[op] = 0
        return op, {"Azure-AsyncOperation": f"{ARM}/fake-operations/{op}?api-version=2020-01-01"}

    def _operation(self, op: str) -> tuple[int, dict[str, str], Any]:
        statuses = self._operations[op]
        self.operation_polls[op] += 1
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        return 200, {}, {"id": op, "status": status}

    def _store(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        name = path.rstrip("/").rsplit("/", 1)[1]
        body["id"] = path
        body["name"] = name
        properties = body.setdefault("properties", {})
        properties["provisioningState"] = "Succeeded"
        lower = path.lower()
        if "/microsoft.containerregistry/registries/" in lower:
            properties["loginServer"] = f"{name.lower()}.azurecr.io"
        if lower.endswith(f"/managedclusters/{name.lower()}"):
            properties["identityProfile"] = {
                "kubeletidentity": {"objectId": KUBELET_OBJECT_ID, "clientId": "kubelet-client"}
            }
            for pool in properties.pop("agentPoolProfiles", []):
                pool_body = {"properties": {k: v for k, v in pool.items() if k != "name"}}
                self._store(f"{path}/agentPools/{pool['name']}", pool_body)
        self.resources[lower] = body
        return body

    def _put(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
        in_rg = _IN_RG.match(path)
        if in_rg and f"/subscriptions/{SUBSCRIPTION}/resourcegroups/{in_rg['rg']}".lower() not in (
            self.resources
        ):
            return _error(404, "ResourceGroupNotFound", f"resource group {in_rg['rg']} not found")
        existed = path.lower() in self.resources
        stored = self._store(path, copy.deepcopy(body))
        if _RG.match(path):  # resource groups are written synchronously
            return (200 if existed else 201), {}, stored
        _, headers = self._lro()
        answer = copy.deepcopy(stored)
        answer["properties"]["provisioningState"] = "Updating" if existed else "Creating"
        return (200 if existed else 201), headers, answer

    def _delete(self, path: str) -> tuple[int, dict[str, str], Any]:
        lower = path.lower()
        if lower not in self.resources:
            return 204, {}, None
        for key in [k for k in self.resources if k == lower or k.startswith(lower + "/")]:
            del self.resources[key]
        _, headers = self._lro()
        return 202, headers, None

    def _provider(self, namespace: str, *, register: bool) -> tuple[int, dict[str, str], Any]:
        state = self.providers.get(namespace, "Registered")
        if register:
            self.providers[namespace] = "Registering"
            state = "Registering"
        elif state == "Registering":
            self.providers[namespace] = "Registered"  # done by the second look
        return (
            200,
            {},
            {"id": f"/providers/{namespace}", "namespace": namespace, "registrationState": state},
        )

    def _role(
        self,
        method: str,
        scope: str,
        name: str | None,
        query: dict[str, list[str]],
        body: Any,
    ) -> tuple[int, dict[str, str], Any]:
        if name is None:  # list, filtered by principal
            wanted = re.search(r"principalId eq '([^']+)'", query.get("$filter", [""])[0])
            items = [
                a
                for a in self.role_assignments.values()
                if a["properties"]["scope"].lower() == scope.lower()
                and (wanted is None or a["properties"]["principalId"] == wanted.group(1))
            ]
            return 200, {}, {"value": items}
        if method != "PUT":
            return _error(405, "MethodNotAllowed", method)
        if self.role_failures:
            status, code = self.role_failures.pop(0)
            return _error(status, code, f"{code} (queued by the test)")
        key = f"{scope}/{name}".lower()
        if key in self.role_assignments:
            return _error(409, "RoleAssignmentExists", "The role assignment already exists.")
        assignment = {
            "id": f"{scope}/providers/Microsoft.Authorization/roleAssignments/{name}",
            "name": name,
            "type": "Microsoft.Authorization/roleAssignments",
            "properties": {**body["properties"], "scope": scope},
        }
        self.role_assignments[key] = assignment
        return 201, {}, assignment


def _error(status: int, code: str, message: str) -> tuple[int, dict[str, str], Any]:
    return status, {"x-ms-error-code": code}, {"error": {"code": code, "message": message}}
