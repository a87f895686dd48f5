"""A tenant's HTTP client sending numbers the gateway reads itself (Last-Event-ID, `limit`)
spelled in ways Python's str.isdigit accepts but int() does not: refused, never a 500."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_stack import Stack, gateway_stack

BODY = {"pool_id": "p1", "shape": {"cpu_millis": 100, "memory_mib": 64},
        "maximum_runtime_seconds": 600}
# a superscript digit (latin-1, so a valid header byte), Arabic-Indic digits, too many digits
# for int(), one past the largest sequence a stream can have
BAD_NUMBERS = ["\u00b2", "\u0661\u0662", "9" * 5000, str(2**63)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_secin_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("secin")
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


def test_a_last_event_id_that_is_not_plain_ascii_digits_is_refused(stack: Stack) -> None:
    with stack.client("alpha") as c:
        lid = c.post("/v1/compute-leases", json=BODY).json()["lease_id"]
        answers = {}
        for raw in BAD_NUMBERS:
            for path in (f"/v1/compute-leases/{lid}/events", f"/v1/compute-leases/{lid}/logs",
                         "/v1/telemetry"):
                r = c.get(path, params={"last_event_id": raw})
                answers[(path, raw[:8])] = (r.status_code, r.json().get("code"))
            if raw.encode("latin-1", "ignore").decode("latin-1") == raw and len(raw) < 100:
                r = c.get(f"/v1/compute-leases/{lid}/events",
                          headers={b"Last-Event-ID": raw.encode("latin-1")})
                answers[("header", raw[:8])] = (r.status_code, r.json().get("code"))
    assert set(answers.values()) == {(422, "invalid_field")}, answers


def test_a_limit_that_is_not_plain_ascii_digits_is_refused(stack: Stack) -> None:
    with stack.client("alpha") as c:
        answers = {raw[:8]: c.get("/v1/compute-leases", params={"limit": raw})
                   for raw in BAD_NUMBERS}
    got = {k: (r.status_code, r.json().get("code")) for k, r in answers.items()}
    assert set(got.values()) == {(422, "invalid_field")}, got
