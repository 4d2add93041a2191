"""The published schema says what the service really answers on errors."""

from __future__ import annotations

from pathlib import Path

from orchard_env.orchestrator.app import create_app
from orchard_env.protocol import ErrorBody
from tests.orchestrator.conftest import Service, make_settings


def test_schema_documents_error_bodies_not_fastapi_422(tmp_path: Path) -> None:
    schema = create_app(make_settings(tmp_path)).openapi()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    error_ref = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            assert responses["default"]["content"]["application/json"]["schema"] == error_ref
    create = schema["paths"]["/sandboxes"]["post"]["responses"]
    assert create["400"]["content"]["application/json"]["schema"] == error_ref


async def test_real_error_answers_match_the_documented_body(service: Service) -> None:
    bad = await service.http.post("/sandboxes", json={"image": "Not An Image"})
    assert bad.status_code == 400
    body = ErrorBody.model_validate(bad.json())
    assert body.detail.code == "invalid_request"
    missing = await service.http.get("/sandboxes/nope")
    assert ErrorBody.model_validate(missing.json()).detail.code == "sandbox_not_found"
