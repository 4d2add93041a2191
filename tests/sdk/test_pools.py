"""Warm pools through both SDK clients against a live orchestrator (fake backend)."""

from __future__ import annotations

import asyncio

import pytest

from orchard_env import errors
from orchard_env.sdk import AsyncSandboxClient, SandboxClient
from tests.servers import Live


async def test_async_client_manages_pools_and_claims_from_them(live: Live) -> None:
    async with AsyncSandboxClient(base_url=live.url, api_key=live.api_key) as client:
        made = await client.create_pool("async", "debian:12", 1, cpu=0.5, env={"A": "1"})
        assert (made.name, made.size, made.cpu, made.env) == ("async", 1, "0.5", {"A": "1"})
        for _ in range(600):
            if (await client.get_pool("async")).ready == 1:
                break
            await asyncio.sleep(0.05)
        sandbox = await client.create_sandbox("debian:12", cpu=0.5, env={"A": "1"})
        assert sandbox.info.status == "ready"
        assert (await sandbox.exec("echo $A")).stdout == "1\n"
        await sandbox.delete()
        assert [p.name for p in await client.list_pools()] == ["async"]
        assert (await client.resize_pool("async", 0)).size == 0
        assert (await client.delete_pool("async")).name == "async"
        with pytest.raises(errors.PoolNotFound, match="pool async does not exist"):
            await client.get_pool("async")


def test_sync_client_validates_before_sending(live: Live) -> None:
    with SandboxClient(base_url=live.url, api_key=live.api_key) as client:
        with pytest.raises(errors.InvalidRequest, match="size"):
            client.create_pool("sync", "debian:12", -1)
        made = client.create_pool("sync", "debian:12", 0, memory="1Gi", ttl_seconds=120)
        assert (made.memory, made.ttl_seconds) == ("1Gi", 120)
        assert client.resize_pool("sync", 0).ready == 0
        assert [p.name for p in client.list_pools()] == ["sync"]
        client.delete_pool("sync")
