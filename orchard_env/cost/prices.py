"""Azure prices: the shipped table, the Retail Prices API client and its cache, one lookup.

Three layers answer "what does this VM cost per hour here?":

1. The **shipped table** (``data/azure_prices.json``, package data): SKU specs and the few
   prices Orchard's reference notes give, each with a status (sourced / unconfirmed / derived)
   and a source. Works offline.
2. **Live prices** from the Azure Retail Prices API (``--live``), written to a cache under
   ``$XDG_CACHE_HOME/orchard/prices/`` with the date they were fetched; later runs without
   ``--live`` reuse that cache (status ``cached``).
3. An **assumption** for a spot price nobody has confirmed: the on-demand price times the one
   sourced spot/on-demand ratio (D8as_v5, eastus). Always labelled ``assumed``.

:class:`PriceBook` combines them; every price it returns is a :class:`PriceQuote` that says
which layer it came from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchard_env.errors import ConfigError, InvalidRequest, Unavailable

Priority = Literal["on_demand", "spot", "low_priority"]
PriceStatus = Literal["sourced", "unconfirmed", "derived", "assumed", "live", "cached"]
PriceMode = Literal["auto", "shipped", "live"]

GIB = 1024**3
RETAIL_PRICES_URL = "https://prices.azure.com/api/retail/prices"
MAX_PAGES = 100
STALE_CACHE_DAYS = 30

_REGION_RE = re.compile(r"^[a-z0-9]{2,40}$")
_SKU_RE = re.compile(r"^Standard_[A-Za-z0-9_]{2,40}$")


# --- the shipped table --------------------------------------------------------------------


class VmSku(BaseModel):
    """A VM size's shape (from the shipped table; the price API does not return shapes)."""

    model_config = ConfigDict(frozen=True)

    name: str
    series: str
    vcpus: int = Field(gt=0)
    memory_gib: float = Field(gt=0)
    temp_disk_gib: int = Field(ge=0)

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def supports_ephemeral_os_disk(self) -> bool:
        """Ephemeral OS disks need a temp disk (Dasv5/Dsv5/Easv5 have none; the `d` sizes do)."""
        return self.temp_disk_gib > 0


class _SkuSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    series: str
    vcpus: int = Field(gt=0)
    memory_gib: float = Field(gt=0)
    temp_disk_gib: int = Field(ge=0)


class VmPriceRow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sku: str
    region: str
    priority: Priority
    usd_per_hour: float = Field(ge=0)
    status: Literal["sourced", "unconfirmed", "derived"]
    source: str
    as_of: str | None = None
    note: str | None = None


class Rate(BaseModel):
    """A non-VM price (control plane, load balancer, disk, registry, data)."""

    model_config = ConfigDict(extra="forbid")

    usd: float = Field(ge=0)
    per: Literal["hour", "day", "month", "GB"]
    status: Literal["sourced", "unconfirmed", "derived"]
    source: str
    note: str | None = None


class ServiceRates(BaseModel):
    model_config = ConfigDict(extra="forbid")

    control_plane: dict[Literal["free", "standard", "premium"], Rate]
    load_balancer: Rate
    public_ip: Rate
    managed_os_disk: Rate
    registry: dict[Literal["basic", "standard", "premium"], Rate]
    log_analytics: Rate
    egress: Rate


class _SkuRef(BaseModel):
    sku: str
    region: str


class PriceTable(BaseModel):
    """``data/azure_prices.json``, validated."""

    model_config = ConfigDict(extra="forbid")

    currency: Literal["USD"]
    as_of: str
    hours_per_month: float = Field(gt=0)
    default_region: str
    notes: str
    sources: dict[str, str]
    skus: dict[str, _SkuSpec]
    default_candidates: list[str]
    spot_ratio_reference: _SkuRef
    vm_prices: list[VmPriceRow]
    services: ServiceRates

    def sku(self, name: str) -> VmSku:
        spec = self.skus.get(name)
        if spec is None:
            raise ConfigError(
                f"unknown VM size {name!r}: Orchard has no shape (vCPUs, memory) for it",
                hint="known sizes: " + ", ".join(self.skus),
            )
        return VmSku(name=name, **spec.model_dump())

    def source_text(self, key: str) -> str:
        return self.sources.get(key, key)


def load_price_table() -> PriceTable:
    """The shipped price table (package data)."""
    text = resources.files("orchard_env.cost").joinpath("data/azure_prices.json").read_text()
    return PriceTable.model_validate_json(text)


# --- quotes ---------------------------------------------------------------------------------


class PriceQuote(BaseModel):
    """One VM price with where it came from."""

    sku: str
    region: str
    priority: Priority
    usd_per_hour: float
    status: PriceStatus
    source: str
    as_of: str | None = None
    note: str | None = None

    @property
    def confirmed(self) -> bool:
        return self.status in ("sourced", "live", "cached")


class PriceSourceInfo(BaseModel):
    """Which layers answered: shown under every estimate."""

    mode: Literal["shipped", "cached", "live"]
    table_as_of: str
    region: str
    fetched_at: datetime | None = None
    cache_file: str | None = None


# --- the Retail Prices API ------------------------------------------------------------------


class LivePrice(BaseModel):
    usd_per_hour: float
    effective_start: datetime
    meter_name: str
    product_name: str


class LiveRegionPrices(BaseModel):
    """What one ``--live`` fetch learned for a region (also the cache file's content)."""

    region: str
    fetched_at: datetime
    source_url: str = RETAIL_PRICES_URL
    skus: dict[str, dict[Priority, LivePrice]] = Field(default_factory=dict)
    missing: list[str] = Field(default_factory=list)


@dataclass
class Classified:
    """Linux consumption prices by (armSkuName, priority), plus what was dropped and why."""

    prices: dict[tuple[str, Priority], LivePrice] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _priority_of(item: Mapping[str, Any]) -> Priority:
    names = (str(item.get("meterName", "")), str(item.get("skuName", "")))
    if any(name.endswith(" Low Priority") for name in names):
        return "low_priority"
    if any(name.endswith(" Spot") for name in names):
        return "spot"
    return "on_demand"


def classify_vm_items(items: Iterable[Mapping[str, Any]]) -> Classified:
    """Keep Linux pay-as-you-go hourly VM prices; tell Spot from Low Priority.

    Drops Reservation and DevTestConsumption rows, Windows and Cloud Services products,
    non-hourly units and non-USD rows. Where one SKU has several rows of the same kind, the
    newest ``effectiveStartDate`` wins.
    """
    result = Classified()
    for item in items:
        if item.get("type") != "Consumption":
            result.skip(f"type {item.get('type')}")
            continue
        if item.get("currencyCode", "USD") != "USD":
            result.skip("not USD")
            continue
        if item.get("unitOfMeasure") != "1 Hour":
            result.skip(f"unit {item.get('unitOfMeasure')}")
            continue
        product = str(item.get("productName", ""))
        if "Windows" in product:
            result.skip("Windows")
            continue
        if "Cloud Services" in product or not product.startswith("Virtual Machines"):
            result.skip("not a Linux VM product")
            continue
        sku = item.get("armSkuName")
        try:
            price = LivePrice(
                usd_per_hour=float(item["retailPrice"]),
                effective_start=item["effectiveStartDate"],
                meter_name=str(item.get("meterName", "")),
                product_name=product,
            )
        except (KeyError, TypeError, ValueError, ValidationError):
            result.skip("malformed")
            continue
        if not isinstance(sku, str) or not sku:
            result.skip("malformed")
            continue
        key = (sku, _priority_of(item))
        current = result.prices.get(key)
        if current is None or price.effective_start > current.effective_start:
            result.prices[key] = price
    return result


def is_vm_size_name(name: str) -> bool:
    """Whether ``name`` looks like an Azure VM size (``Standard_...``)."""
    return bool(_SKU_RE.match(name))


def vm_price_filter(region: str, sku: str) -> str:
    """The OData ``$filter`` for one SKU's consumption prices in one region."""
    if not _REGION_RE.match(region):
        raise InvalidRequest(
            f"region {region!r} is not an Azure region name", hint="use the ARM name, e.g. eastus"
        )
    if not _SKU_RE.match(sku):
        raise InvalidRequest(
            f"VM size {sku!r} is not an Azure VM size name", hint="e.g. Standard_D8as_v5"
        )
    return (
        f"serviceName eq 'Virtual Machines' and armRegionName eq '{region}' "
        f"and armSkuName eq '{sku}' and priceType eq 'Consumption'"
    )


class RetailPricesClient:
    """The public Azure Retail Prices API (no auth). Inject ``transport=`` in tests.

    ``ORCHARD_RETAIL_PRICES_URL`` points it elsewhere (a mirror, or a proxy that caches).
    """

    def __init__(
        self,
        *,
        transport: httpx.BaseTransport | None = None,
        timeout: float = 30.0,
        url: str | None = None,
    ) -> None:
        self.url = url or os.environ.get("ORCHARD_RETAIL_PRICES_URL") or RETAIL_PRICES_URL
        self._http = httpx.Client(transport=transport, timeout=timeout, follow_redirects=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _get_json(self, url: str, params: Mapping[str, str] | None) -> dict[str, Any]:
        hint = "check your connection and retry, or drop --live to use the shipped price table"
        try:
            response = self._http.get(url, params=params)
        except httpx.HTTPError as exc:
            raise Unavailable(
                f"could not reach the Azure Retail Prices API ({self.url}): {exc}", hint=hint
            ) from exc
        if response.status_code != 200:
            raise Unavailable(
                f"the Azure Retail Prices API answered HTTP {response.status_code}: "
                f"{response.text[:200]}",
                hint=hint,
            )
        try:
            body = response.json()
        except ValueError as exc:
            raise Unavailable(
                "the Azure Retail Prices API returned something that is not JSON", hint=hint
            ) from exc
        if not isinstance(body, dict) or not isinstance(body.get("Items"), list):
            raise Unavailable(
                "the Azure Retail Prices API returned JSON without an Items list", hint=hint
            )
        return body

    def items(self, odata_filter: str) -> list[dict[str, Any]]:
        """Every item matching ``odata_filter``, following ``NextPageLink`` to the end."""
        collected: list[dict[str, Any]] = []
        url: str | None = self.url
        params: dict[str, str] | None = {"$filter": odata_filter}
        seen: set[str] = set()
        hint = "retry later, or drop --live to use the shipped price table"
        while url is not None:
            if len(seen) >= MAX_PAGES:
                raise Unavailable(
                    f"the Azure Retail Prices API kept paging after {MAX_PAGES} pages", hint=hint
                )
            body = self._get_json(url, params)
            collected.extend(item for item in body["Items"] if isinstance(item, dict))
            seen.add(url)
            next_link = body.get("NextPageLink")
            if next_link is not None and (not isinstance(next_link, str) or next_link in seen):
                raise Unavailable(
                    f"the Azure Retail Prices API returned a bad NextPageLink: {next_link!r}",
                    hint=hint,
                )
            url, params = next_link or None, None
        return collected

    def vm_prices(
        self, region: str, skus: Iterable[str], *, now: datetime | None = None
    ) -> LiveRegionPrices:
        """Linux on-demand, spot and low-priority prices of ``skus`` in ``region``."""
        live = LiveRegionPrices(region=region, fetched_at=now or datetime.now(UTC))
        for sku in dict.fromkeys(skus):
            classified = classify_vm_items(self.items(vm_price_filter(region, sku)))
            found = {
                priority: price
                for (name, priority), price in classified.prices.items()
                if name == sku
            }
            if found:
                live.skus[sku] = found
            else:
                live.missing.append(sku)
        return live


# --- cache ----------------------------------------------------------------------------------


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orchard" / "prices"


def cache_file(region: str, directory: Path | None = None) -> Path:
    return (directory or cache_dir()) / f"azure-{region}.json"


def read_cache(region: str, directory: Path | None = None) -> LiveRegionPrices | None:
    """Cached live prices for ``region``, or None (a corrupt cache counts as none)."""
    path = cache_file(region, directory)
    try:
        return LiveRegionPrices.model_validate_json(path.read_text())
    except (FileNotFoundError, ValidationError, ValueError):
        return None


def write_cache(live: LiveRegionPrices, directory: Path | None = None) -> Path:
    """Merge ``live`` into the region's cache file (newer SKUs replace older ones)."""
    path = cache_file(live.region, directory)
    merged = live
    previous = read_cache(live.region, directory)
    if previous is not None:
        skus = {**previous.skus, **live.skus}
        missing = sorted((set(previous.missing) - set(live.skus)) | set(live.missing))
        merged = live.model_copy(update={"skus": skus, "missing": missing})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(merged.model_dump_json(indent=2))
    tmp.replace(path)
    return path


# --- the price book -------------------------------------------------------------------------


class PriceBook:
    """Prices from the live/cached layer first, then the shipped table, then the assumption."""

    def __init__(
        self,
        table: PriceTable,
        live: LiveRegionPrices | None = None,
        *,
        live_status: Literal["live", "cached"] = "live",
        cache_path: Path | None = None,
    ) -> None:
        self.table = table
        self.live = live
        self.live_status = live_status
        self.cache_path = cache_path

    def sku(self, name: str) -> VmSku:
        return self.table.sku(name)

    def source_info(self, region: str) -> PriceSourceInfo:
        if self.live is None:
            return PriceSourceInfo(mode="shipped", table_as_of=self.table.as_of, region=region)
        return PriceSourceInfo(
            mode=self.live_status,
            table_as_of=self.table.as_of,
            region=region,
            fetched_at=self.live.fetched_at,
            cache_file=str(self.cache_path) if self.cache_path else None,
        )

    def _live_quote(self, sku: str, region: str, priority: Priority) -> PriceQuote | None:
        if self.live is None or self.live.region != region:
            return None
        price = self.live.skus.get(sku, {}).get(priority)
        if price is None:
            return None
        return PriceQuote(
            sku=sku,
            region=region,
            priority=priority,
            usd_per_hour=price.usd_per_hour,
            status=self.live_status,
            source=f"Azure Retail Prices API, meter {price.meter_name!r}",
            as_of=self.live.fetched_at.date().isoformat(),
            note=f"effective from {price.effective_start.date().isoformat()}",
        )

    def _shipped_quote(self, sku: str, region: str, priority: Priority) -> PriceQuote | None:
        for row in self.table.vm_prices:
            if (row.sku, row.region, row.priority) == (sku, region, priority):
                return PriceQuote(
                    sku=sku,
                    region=region,
                    priority=priority,
                    usd_per_hour=row.usd_per_hour,
                    status=row.status,
                    source=self.table.source_text(row.source),
                    as_of=row.as_of,
                    note=row.note,
                )
        return None

    def spot_ratio(self) -> tuple[float, str]:
        """The one sourced spot/on-demand ratio and a sentence saying where it comes from."""
        ref = self.table.spot_ratio_reference
        spot = self._shipped_quote(ref.sku, ref.region, "spot")
        on_demand = self._shipped_quote(ref.sku, ref.region, "on_demand")
        if spot is None or on_demand is None or on_demand.usd_per_hour == 0:
            raise ConfigError(
                "the shipped price table lacks the spot ratio reference prices",
                hint="the package data is damaged: reinstall orchard",
            )
        ratio = spot.usd_per_hour / on_demand.usd_per_hour
        basis = (
            f"{ratio:.4f} = {ref.sku} {ref.region} spot ${spot.usd_per_hour:g} / "
            f"on-demand ${on_demand.usd_per_hour:g} ({spot.as_of})"
        )
        return ratio, basis

    def vm_price(self, sku: str, region: str, priority: Priority) -> PriceQuote:
        """The hourly price, or :class:`ConfigError` naming what is missing and what to do."""
        quote = self._live_quote(sku, region, priority) or self._shipped_quote(
            sku, region, priority
        )
        if quote is not None:
            return quote
        if priority == "spot":
            on_demand = self.vm_price(sku, region, "on_demand")
            ratio, basis = self.spot_ratio()
            return PriceQuote(
                sku=sku,
                region=region,
                priority="spot",
                usd_per_hour=round(on_demand.usd_per_hour * ratio, 6),
                status="assumed",
                source=f"on-demand x spot ratio {basis}",
                as_of=on_demand.as_of,
                note=f"no confirmed spot price for {sku} in {region}; --live fetches it",
            )
        regions = sorted({row.region for row in self.table.vm_prices})
        if self.live is not None and self.live.region == region:
            hint = f"the Retail Prices API had no Linux {priority} price for {sku} in {region}"
        else:
            hint = (
                f"the shipped table covers {', '.join(regions)} for a few sizes only; "
                f"rerun with --live to fetch {region} prices"
            )
        raise ConfigError(f"no {priority.replace('_', '-')} price for {sku} in {region}", hint=hint)

    def has_price(self, sku: str, region: str) -> bool:
        try:
            self.vm_price(sku, region, "on_demand")
        except ConfigError:
            return False
        return True


def load_price_book(
    mode: PriceMode,
    region: str,
    skus: Iterable[str],
    *,
    client: RetailPricesClient | None = None,
    directory: Path | None = None,
    now: datetime | None = None,
) -> PriceBook:
    """The price book for a run: shipped only, cache-if-any (auto), or freshly fetched (live).

    ``live`` fetches ``skus`` (any Azure size name; a shape is only needed to pack sandboxes)
    in ``region`` and merges them into the cache file; ``auto``
    reuses that cache when it exists. Fetch failures raise :class:`Unavailable` with a hint
    to use the shipped table.
    """
    table = load_price_table()
    if mode == "shipped":
        return PriceBook(table)
    path = cache_file(region, directory)
    if mode == "auto":
        cached = read_cache(region, directory)
        if cached is None:
            return PriceBook(table)
        return PriceBook(table, cached, live_status="cached", cache_path=path)
    owned = client is None
    active = client or RetailPricesClient()
    try:
        live = active.vm_prices(region, skus, now=now)
    finally:
        if owned:
            active.close()
    write_cache(live, directory)
    return PriceBook(table, live, live_status="live", cache_path=path)


def cache_age_days(info: PriceSourceInfo, now: datetime | None = None) -> float | None:
    """How old cached prices are, in days (None unless they came from the cache)."""
    if info.mode != "cached" or info.fetched_at is None:
        return None
    return ((now or datetime.now(UTC)) - info.fetched_at).total_seconds() / 86400
