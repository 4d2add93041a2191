"""Error codes survive the wire: the class raised on one side is rebuilt on the other."""

from __future__ import annotations

import pytest

from orchard_env import errors


def _all_classes() -> list[type[errors.OrchardError]]:
    found: list[type[errors.OrchardError]] = []
    pending: list[type[errors.OrchardError]] = [errors.OrchardError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


@pytest.mark.parametrize("cls", _all_classes(), ids=lambda c: c.__name__)
def test_every_error_round_trips(cls: type[errors.OrchardError]) -> None:
    raised = cls("something went wrong", hint="do this instead")
    rebuilt = errors.error_from_wire(cls.http_status, raised.to_wire())
    assert type(rebuilt) is cls
    assert rebuilt.message == "something went wrong"
    assert rebuilt.hint == "do this instead"


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in _all_classes()]
    assert len(codes) == len(set(codes))


def test_unknown_code_falls_back_to_base_class() -> None:
    rebuilt = errors.error_from_wire(500, {"detail": {"code": "from_the_future", "message": "m"}})
    assert type(rebuilt) is errors.OrchardError


def test_plain_fastapi_detail_uses_the_status() -> None:
    assert isinstance(errors.error_from_wire(404, {"detail": "Not Found"}), errors.NotFound)
    assert isinstance(errors.error_from_wire(503, {"detail": "busy"}), errors.Unavailable)
    assert type(errors.error_from_wire(418, {"detail": "teapot"})) is errors.OrchardError


def test_validation_list_names_the_field() -> None:
    body = {"detail": [{"loc": ["body", "cpu"], "msg": "cpu 'x' is not a quantity"}]}
    rebuilt = errors.error_from_wire(422, body)
    assert isinstance(rebuilt, errors.InvalidRequest)
    assert rebuilt.message == "cpu: cpu 'x' is not a quantity"


def test_default_hint_is_kept_unless_overridden() -> None:
    assert errors.EngineNotFound("no engine").hint is not None
    assert errors.EngineNotFound("no engine", hint="other").hint == "other"
