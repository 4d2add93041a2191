"""Fakes at the HTTP seam, served over real sockets on 127.0.0.1: a Kubernetes API serving
nodes (with limit/continue paging) and the Azure Retail Prices API (with NextPageLink)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

NOW = datetime(2026, 8, 1, 12, tzinfo=UTC)


def hours_ago(hours: float) -> datetime:
    return NOW - timedelta(hours=hours)


def node_json(
    name: str,
    *,
    pool: str,
    size: str,
    created: datetime,
    spot: bool = False,
    mode: str = "user",
    sandbox: bool = False,
    legacy_pool_label: bool = False,
) -> dict[str, Any]:
    labels = {
        "node.kubernetes.io/instance-type": size,
        "topology.kubernetes.io/region": "eastus",
        "kubernetes.azure.com/mode": mode,
        ("agentpool" if legacy_pool_label else "kubernetes.azure.com/agentpool"): pool,
    }
    if spot:
        labels["kubernetes.azure.com/scalesetpriority"] = "spot"
    if sandbox:
        labels["workload"] = "sandbox"
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ"),
        },
        "status": {"allocatable": {"cpu": "7420m", "memory": "31268Mi", "pods": "30"}},
    }


def cluster_nodes(now: datetime) -> list[dict[str, Any]]:
    """A system node up 10 h, two spot sandbox nodes up 4 h and 2 h, one unpriceable node."""

    def ago(hours: float) -> datetime:
        return now - timedelta(hours=hours)

    return [
        node_json("aks-sys-0", pool="sys", size="Standard_D4as_v5", created=ago(10), mode="system"),
        node_json(
            "aks-sbx-0",
            pool="sbx",
            size="Standard_D8as_v5",
            created=ago(4),
            spot=True,
            sandbox=True,
        ),
        node_json(
            "aks-sbx-1",
            pool="sbx",
            size="Standard_D8as_v5",
            created=ago(2),
            spot=True,
            sandbox=True,
        ),
        node_json(
            "aks-odd-0",
            pool="odd",
            size="Standard_Weird_v9",
            created=ago(1),
            legacy_pool_label=True,
        ),
    ]


NODES = cluster_nodes(NOW)


class _JsonHandler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return

    def _send(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Run ``server`` in a thread; yields its base URL."""
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class FakeKubeApi(ThreadingHTTPServer):
    token = "secret-token"

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        super().__init__(("127.0.0.1", 0), _KubeHandler)
        self.nodes = nodes
        self.paths: list[str] = []
        self.deny = False


class _KubeHandler(_JsonHandler):
    server: FakeKubeApi

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        url = urlsplit(self.path)
        if self.headers.get("Authorization") != f"Bearer {self.server.token}" or self.server.deny:
            self._send(403, {"kind": "Status", "reason": "Forbidden", "code": 403})
            return
        if url.path != "/api/v1/nodes":
            self._send(404, {"kind": "Status", "reason": "NotFound", "code": 404})
            return
        query = parse_qs(url.query)
        limit = int(query.get("limit", ["500"])[0])
        start = int(query.get("continue", ["0"])[0])
        page = self.server.nodes[start : start + limit]
        more = start + limit < len(self.server.nodes)
        self._send(
            200,
            {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {"continue": str(start + limit)} if more else {},
                "items": page,
            },
        )


def write_kubeconfig(path: Path, server: str, token: str = FakeKubeApi.token) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: {server}
contexts:
- name: fake
  context:
    cluster: fake
    user: fake
current-context: fake
users:
- name: fake
  user:
    token: {token}
"""
    )
    return path


def price_row(**overrides: Any) -> dict[str, Any]:
    """A Linux on-demand D8as_v5 row as the Retail Prices API serves it."""
    item = {
        "currencyCode": "USD",
        "retailPrice": 0.344,
        "unitPrice": 0.344,
        "armRegionName": "eastus",
        "effectiveStartDate": "2023-01-01T00:00:00Z",
        "meterName": "D8as v5",
        "productName": "Virtual Machines Dasv5 Series",
        "skuName": "D8as v5",
        "serviceName": "Virtual Machines",
        "unitOfMeasure": "1 Hour",
        "type": "Consumption",
        "isPrimaryMeterRegion": True,
        "armSkuName": "Standard_D8as_v5",
    }
    item.update(overrides)
    return item


class FakePricesServer(ThreadingHTTPServer):
    """The Retail Prices API: rows per SKU, ``page_size`` per page, or one fixed failure."""

    def __init__(self, rows_by_sku: dict[str, list[dict[str, Any]]], page_size: int = 2) -> None:
        super().__init__(("127.0.0.1", 0), _PricesHandler)
        self.rows_by_sku = rows_by_sku
        self.page_size = page_size
        self.fail_status: int | None = None
        self.paths: list[str] = []


class _PricesHandler(_JsonHandler):
    server: FakePricesServer

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        if self.server.fail_status is not None:
            self._send(self.server.fail_status, {"error": "unavailable"})
            return
        query = parse_qs(urlsplit(self.path).query)
        odata = query["$filter"][0]
        sku = odata.split("armSkuName eq '")[1].split("'")[0]
        skip = int(query.get("$skip", ["0"])[0])
        rows = self.server.rows_by_sku.get(sku, [])
        size = self.server.page_size
        next_link = None
        if skip + size < len(rows):
            params = urlencode({"$filter": odata, "$skip": skip + size})
            next_link = f"http://127.0.0.1:{self.server.server_port}/api/retail/prices?{params}"
        self._send(200, {"Items": rows[skip : skip + size], "NextPageLink": next_link})
