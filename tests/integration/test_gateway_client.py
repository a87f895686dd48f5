"""A typed client generated from the gateway's own /openapi.json (openapi-python-client, as a
user would) reads and writes leases on a real stack: the document is complete enough to use."""

from __future__ import annotations

import importlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.gateway_stack import Stack, gateway_stack

PACKAGE = "computepool_client"
# the concept's example request, verbatim
CONCEPT_BODY = {"pool_id": "p1",
                "shape": {"gpu_count": 0, "gpu_memory_gib_min": 0, "cpu_millis": 500,
                          "memory_mib": 256},
                "maximum_runtime_seconds": 600}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[Stack]:
    from projections.views import drop_schema

    schema = "views_gwc_" + uuid.uuid4().hex[:8]
    try:
        with gateway_stack(tmp_path_factory.mktemp("gwc"), database_url, schema) as s:
            yield s
    finally:
        drop_schema(database_url, schema)


def _generate(document: Path, into: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "openapi-python-client"
    if not exe.exists():
        pytest.fail("openapi-python-client is not installed beside this Python: "
                    "pip install -e '.[test]'")
    config = into / "config.yaml"
    # no post hooks: formatting the output (ruff) is the generator's business, not ours
    config.write_text("post_hooks: []\n")
    return subprocess.run([str(exe), "generate", "--path", str(document), "--meta", "none",
                           "--output-path", str(into / PACKAGE), "--config", str(config),
                           "--fail-on-warning"],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def client_package(stack: Stack, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[ModuleType]:
    """The client generated from what the gateway serves, imported from a temporary folder."""
    into = tmp_path_factory.mktemp("client")
    document = into / "openapi.json"
    document.write_bytes(httpx.get(stack.url + "/openapi.json").content)
    done = _generate(document, into)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "warning" not in output.lower(), output
    sys.path.insert(0, str(into))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(into))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _module(name: str) -> Any:
    return importlib.import_module(f"{PACKAGE}.{name}")


def test_a_generated_client_creates_and_reads_back_a_typed_lease(
    stack: Stack, client_package: ModuleType,
) -> None:
    create = _module("api.leases.create_compute_lease")
    get = _module("api.leases.get_compute_lease")
    models = _module("models")
    with client_package.AuthenticatedClient(base_url=stack.url,
                                            token=stack.tokens["alpha"]) as client:
        made = create.sync_detailed(client=client, body=models.LeaseCreate.from_dict(CONCEPT_BODY),
                                    idempotency_key="typed-" + uuid.uuid4().hex)
        assert made.status_code == 201, made.content
        assert isinstance(made.parsed, models.Lease), made.content
        assert made.parsed.tenant == "alpha" and made.parsed.pool_id == "p1"
        got = get.sync_detailed(client=client, lease_id=made.parsed.lease_id)
        assert got.status_code == 200, got.content
        assert isinstance(got.parsed, models.Lease), got.content
        assert got.parsed.lease_id == made.parsed.lease_id
        assert got.parsed.shape.to_dict() == made.parsed.shape.to_dict()


def test_a_generated_client_reads_a_refusal_as_a_typed_problem(
    stack: Stack, client_package: ModuleType,
) -> None:
    get = _module("api.leases.get_compute_lease")
    models = _module("models")
    with client_package.AuthenticatedClient(base_url=stack.url,
                                            token=stack.tokens["alpha"]) as client:
        missing = get.sync_detailed(client=client, lease_id="no-such-lease")
    assert missing.status_code == 404
    assert isinstance(missing.parsed, models.Problem), missing.content
    assert missing.parsed.code == "lease_not_found"
