"""The shipped table, the Retail Prices client (against an HTTP-level fake), cache, price book."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from orchard_env.cost.prices import (
    PriceBook,
    RetailPricesClient,
    cache_dir,
    cache_file,
    classify_vm_items,
    load_price_book,
    load_price_table,
    read_cache,
    vm_price_filter,
    write_cache,
)
from orchard_env.errors import ConfigError, InvalidRequest, Unavailable
from tests.cost.fakes import price_row as row

NOW = datetime(2026, 8, 1, 12, tzinfo=UTC)
API = "https://prices.azure.com/api/retail/prices"


MIXED_ROWS = [
    row(),
    row(retailPrice=0.36, effectiveStartDate="2021-06-01T00:00:00Z"),  # older on-demand price
    row(meterName="D8as v5 Spot", skuName="D8as v5 Spot", retailPrice=0.072618),
    row(meterName="D8as v5 Low Priority", skuName="D8as v5 Low Priority", retailPrice=0.0688),
    row(productName="Virtual Machines Dasv5 Series Windows", retailPrice=0.712),
    row(
        productName="Virtual Machines Dasv5 Series Windows",
        meterName="D8as v5 Spot",
        skuName="D8as v5 Spot",
        retailPrice=0.150303,
    ),
    row(type="DevTestConsumption", retailPrice=0.2),
    row(type="Reservation", retailPrice=1800.0, unitOfMeasure="1 Year"),
    row(unitOfMeasure="1/Month", retailPrice=9.0),
    row(productName="Cloud Services Dasv5 Series", retailPrice=0.5),
]


# --- shipped table ---------------------------------------------------------------------------


def test_shipped_table_is_consistent() -> None:
    table = load_price_table()
    for price in table.vm_prices:
        assert price.sku in table.skus, price.sku
        assert price.source in table.sources, price.source
    for name in table.default_candidates:
        assert any(p.sku == name and p.priority == "on_demand" for p in table.vm_prices), name
    for rate in [*table.services.control_plane.values(), *table.services.registry.values()]:
        assert rate.source in table.sources
    assert table.sku("Standard_D8ads_v5").supports_ephemeral_os_disk
    assert not table.sku("Standard_D8as_v5").supports_ephemeral_os_disk


def test_only_d8as_v5_eastus_prices_carry_a_date_and_the_spot_one_is_the_spot_meter() -> None:
    book = PriceBook(load_price_table())
    spot = book.vm_price("Standard_D8as_v5", "eastus", "spot")
    assert (spot.usd_per_hour, spot.status, spot.as_of) == (0.072618, "sourced", "2026-07-27")
    assert book.vm_price("Standard_D8as_v5", "eastus", "low_priority").usd_per_hour == 0.0688
    assert book.vm_price("Standard_D4as_v5", "eastus", "on_demand").as_of is None


def test_unknown_vm_size_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        load_price_table().sku("Standard_X9")
    assert caught.value.message == (
        "unknown VM size 'Standard_X9': Orchard has no shape (vCPUs, memory) for it"
    )
    assert caught.value.hint is not None and "Standard_D8as_v5" in caught.value.hint


def test_unconfirmed_spot_is_assumed_from_the_one_sourced_ratio() -> None:
    book = PriceBook(load_price_table())
    quote = book.vm_price("Standard_D16as_v5", "eastus", "spot")
    assert quote.status == "assumed"
    assert quote.usd_per_hour == round(0.688 * 0.072618 / 0.344, 6) == 0.145236
    assert "Standard_D8as_v5 eastus spot $0.072618 / on-demand $0.344" in quote.source
    assert not quote.confirmed


def test_a_region_the_table_does_not_cover_points_at_live() -> None:
    book = PriceBook(load_price_table())
    with pytest.raises(ConfigError) as caught:
        book.vm_price("Standard_D8as_v5", "westus2", "on_demand")
    assert caught.value.message == "no on-demand price for Standard_D8as_v5 in westus2"
    assert caught.value.hint == (
        "the shipped table covers eastus for a few sizes only; rerun with --live to fetch "
        "westus2 prices"
    )
    assert not book.has_price("Standard_D8as_v5", "westus2")


# --- classification --------------------------------------------------------------------------


def test_classification_keeps_linux_hourly_consumption_and_tells_spot_from_low_priority() -> None:
    classified = classify_vm_items(MIXED_ROWS)
    prices = {key: price.usd_per_hour for key, price in classified.prices.items()}
    assert prices == {
        ("Standard_D8as_v5", "on_demand"): 0.344,
        ("Standard_D8as_v5", "spot"): 0.072618,
        ("Standard_D8as_v5", "low_priority"): 0.0688,
    }
    assert classified.skipped == {
        "Windows": 2,
        "type DevTestConsumption": 1,
        "type Reservation": 1,
        "unit 1/Month": 1,
        "not a Linux VM product": 1,
    }


def test_newest_effective_date_wins_in_any_order() -> None:
    newer = row(retailPrice=0.35, effectiveStartDate="2026-05-01T00:00:00Z")
    for rows in ([row(), newer], [newer, row()]):
        price = classify_vm_items(rows).prices[("Standard_D8as_v5", "on_demand")]
        assert price.usd_per_hour == 0.35


def test_malformed_rows_are_skipped_not_fatal() -> None:
    classified = classify_vm_items([row(retailPrice="n/a"), row(armSkuName=None), row()])
    assert classified.skipped == {"malformed": 2}
    assert len(classified.prices) == 1


def test_filter_rejects_injection() -> None:
    assert vm_price_filter("eastus", "Standard_D8as_v5") == (
        "serviceName eq 'Virtual Machines' and armRegionName eq 'eastus' and armSkuName eq "
        "'Standard_D8as_v5' and priceType eq 'Consumption'"
    )
    with pytest.raises(InvalidRequest):
        vm_price_filter("eastus' or '1' eq '1", "Standard_D8as_v5")
    with pytest.raises(InvalidRequest):
        vm_price_filter("eastus", "Standard_D8as_v5' or 'x")


# --- the client against an HTTP-level fake ----------------------------------------------------


class FakePricesApi:
    """Serves each SKU's rows over several pages linked by NextPageLink, records requests."""

    def __init__(self, rows_by_sku: dict[str, list[dict[str, Any]]], page_size: int = 3) -> None:
        self.rows_by_sku = rows_by_sku
        self.page_size = page_size
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        query = parse_qs(urlsplit(str(request.url)).query)
        odata = query["$filter"][0]
        sku = odata.split("armSkuName eq '")[1].split("'")[0]
        skip = int(query.get("$skip", ["0"])[0])
        rows = self.rows_by_sku.get(sku, [])
        page = rows[skip : skip + self.page_size]
        more = skip + self.page_size < len(rows)
        next_link = None
        if more:
            next_link = str(
                httpx.URL(API, params={"$filter": odata, "$skip": str(skip + self.page_size)})
            )
        body = {
            "BillingCurrency": "USD",
            "CustomerEntityId": "Default",
            "CustomerEntityType": "Retail",
            "Items": page,
            "NextPageLink": next_link,
            "Count": len(page),
        }
        return httpx.Response(200, json=body)


def test_client_follows_next_page_link_and_classifies() -> None:
    api = FakePricesApi({"Standard_D8as_v5": MIXED_ROWS})
    with RetailPricesClient(transport=httpx.MockTransport(api)) as client:
        live = client.vm_prices("eastus", ["Standard_D8as_v5", "Standard_Q1"], now=NOW)
    assert len(api.requests) == 4 + 1  # 10 rows in pages of 3, then one empty answer
    assert api.requests[0].url.params["$filter"] == vm_price_filter("eastus", "Standard_D8as_v5")
    assert api.requests[1].url.params["$skip"] == "3"
    prices = live.skus["Standard_D8as_v5"]
    assert {k: v.usd_per_hour for k, v in prices.items()} == {
        "on_demand": 0.344,
        "spot": 0.072618,
        "low_priority": 0.0688,
    }
    assert prices["spot"].meter_name == "D8as v5 Spot"
    assert live.missing == ["Standard_Q1"]
    assert live.fetched_at == NOW


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (httpx.Response(503, text="busy"), "the Azure Retail Prices API answered HTTP 503: busy"),
        (
            httpx.Response(200, text="<html>"),
            "the Azure Retail Prices API returned something that is not JSON",
        ),
        (
            httpx.Response(200, json={"value": []}),
            "the Azure Retail Prices API returned JSON without an Items list",
        ),
    ],
)
def test_client_errors_suggest_the_shipped_table(response: httpx.Response, message: str) -> None:
    client = RetailPricesClient(transport=httpx.MockTransport(lambda request: response))
    with pytest.raises(Unavailable) as caught:
        client.items("x")
    assert caught.value.message == message
    assert (
        caught.value.hint is not None
        and "drop --live to use the shipped price table" in caught.value.hint
    )


def test_client_reports_connection_failures() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = RetailPricesClient(transport=httpx.MockTransport(refuse))
    with pytest.raises(Unavailable, match="could not reach the Azure Retail Prices API"):
        client.items("x")


def test_client_stops_on_a_next_page_loop() -> None:
    def loop(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"Items": [], "NextPageLink": f"{API}?$skip=3"})

    client = RetailPricesClient(transport=httpx.MockTransport(loop))
    with pytest.raises(Unavailable, match="bad NextPageLink"):
        client.items("x")


# --- cache and price book --------------------------------------------------------------------


def test_cache_dir_honours_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "orchard" / "prices"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "orchard" / "prices"


def live_book(tmp_path: Path, rows: dict[str, list[dict[str, Any]]]) -> PriceBook:
    client = RetailPricesClient(transport=httpx.MockTransport(FakePricesApi(rows)))
    return load_price_book("live", "eastus", list(rows), client=client, directory=tmp_path, now=NOW)


def test_live_prices_win_and_are_cached_with_their_date(tmp_path: Path) -> None:
    rows = {
        "Standard_D8as_v5": [
            row(retailPrice=0.35),
            row(meterName="D8as v5 Spot", retailPrice=0.07),
        ],
        "Standard_D16as_v5": [
            row(armSkuName="Standard_D16as_v5", meterName="D16as v5", retailPrice=0.7)
        ],
    }
    book = live_book(tmp_path, rows)
    quote = book.vm_price("Standard_D8as_v5", "eastus", "spot")
    assert (quote.usd_per_hour, quote.status, quote.as_of) == (0.07, "live", "2026-08-01")
    assert quote.source == "Azure Retail Prices API, meter 'D8as v5 Spot'"
    # The D16 has no spot row: the spot price is assumed from the live on-demand one.
    assumed = book.vm_price("Standard_D16as_v5", "eastus", "spot")
    assert (assumed.status, assumed.usd_per_hour) == ("assumed", round(0.7 * 0.072618 / 0.344, 6))
    # Sizes the fetch did not cover fall back to the shipped table.
    assert book.vm_price("Standard_E8as_v5", "eastus", "on_demand").status == "sourced"

    cached = load_price_book("auto", "eastus", [], directory=tmp_path)
    again = cached.vm_price("Standard_D8as_v5", "eastus", "on_demand")
    assert (again.usd_per_hour, again.status, again.as_of) == (0.35, "cached", "2026-08-01")
    info = cached.source_info("eastus")
    assert (info.mode, info.fetched_at) == ("cached", NOW)
    assert info.cache_file == str(cache_file("eastus", tmp_path))
    shipped = load_price_book("shipped", "eastus", [], directory=tmp_path)
    assert shipped.vm_price("Standard_D8as_v5", "eastus", "on_demand").usd_per_hour == 0.344


def test_cache_merges_fetches_and_ignores_corruption(tmp_path: Path) -> None:
    live_book(tmp_path, {"Standard_D8as_v5": [row()]})
    live_book(
        tmp_path, {"Standard_D16as_v5": [row(armSkuName="Standard_D16as_v5", retailPrice=0.7)]}
    )
    cached = read_cache("eastus", tmp_path)
    assert cached is not None and set(cached.skus) == {"Standard_D8as_v5", "Standard_D16as_v5"}
    cache_file("eastus", tmp_path).write_text("{not json")
    assert read_cache("eastus", tmp_path) is None
    assert load_price_book("auto", "eastus", [], directory=tmp_path).live is None


def test_live_fetch_for_another_region_is_written_to_its_own_file(tmp_path: Path) -> None:
    client = RetailPricesClient(
        transport=httpx.MockTransport(
            FakePricesApi({"Standard_D8as_v5": [row(armRegionName="westus2")]})
        )
    )
    book = load_price_book(
        "live", "westus2", ["Standard_D8as_v5"], client=client, directory=tmp_path, now=NOW
    )
    assert book.vm_price("Standard_D8as_v5", "westus2", "on_demand").status == "live"
    assert json.loads(cache_file("westus2", tmp_path).read_text())["region"] == "westus2"
    assert book.live is not None
    assert write_cache(book.live, tmp_path) == cache_file("westus2", tmp_path)


def test_live_prices_need_no_shape_for_sizes_outside_the_table(tmp_path: Path) -> None:
    book = live_book(
        tmp_path, {"Standard_D8ds_v4": [row(armSkuName="Standard_D8ds_v4", retailPrice=0.452)]}
    )
    assert book.vm_price("Standard_D8ds_v4", "eastus", "on_demand").usd_per_hour == 0.452
    with pytest.raises(ConfigError, match="unknown VM size 'Standard_D8ds_v4'"):
        book.sku("Standard_D8ds_v4")
