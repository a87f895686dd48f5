"""Every operation of the gateway's OpenAPI document, fuzzed with schemathesis against the real
stack: no response is a 5xx and every response matches its documented schema."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.gateway_stack import Stack, gateway_stack

# examples per operation: small in CI, POOL_FUZZ_EXAMPLES for a longer run
EXAMPLES = int(os.environ.get("POOL_FUZZ_EXAMPLES", "6"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_gwfz_" + uuid.uuid4().hex[:8]
    home: Path = tmp_path_factory.mktemp("gwfz")
    try:
        with gateway_stack(home, database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


def _fuzz(op: Any, headers: dict[str, str]) -> None:
    @given(case=op.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        # Left out: "valid data is accepted". The NATS decoder is stricter than JSON Schema can
        # say (101.0 is not an integer to it; a path id and the body's must agree), and such a
        # request is refused with a 4xx problem, which is the behaviour we want.
        case.call_and_validate(headers=headers,
                               excluded_checks=[schemathesis.checks.positive_data_acceptance])

    fuzz()


def test_no_operation_answers_5xx_or_off_its_schema(stack: Stack) -> None:
    api = schemathesis.openapi.from_url(stack.url + "/openapi.json")
    failures: list[str] = []
    ran = 0
    for result in api.get_all_operations():
        op = result.ok()
        if str(op.definition.raw.get("operationId", "")).startswith("stream"):
            continue  # the streams never end by themselves; test_gateway_sse.py covers them
        who = "admin" if op.path.startswith("/v1/admin/") else "alpha"
        headers = {"Authorization": f"Bearer {stack.tokens[who]}"}

        ran += 1
        try:
            _fuzz(op, headers)
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - report every operation
            failures.append(f"{op.method.upper()} {op.path}: {str(e)[:1500]}")
    assert ran >= 20
    assert not failures, "\n\n".join(failures)
