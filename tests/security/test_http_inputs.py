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


def test_a_token_holds_a_bounded_number_of_open_streams(stack: Stack) -> None:
    """Each open stream holds a NATS connection or polls the control plane: one tenant's token
    opening streams without end would take the gateway and the server from everyone else."""
    from contextlib import ExitStack

    from gateway.sse import MAX_STREAMS_PER_TOKEN
    from tests.gateway_stack import wait_for

    with stack.client("alpha") as a, stack.client("beta") as b, ExitStack() as held:
        opened = [held.enter_context(a.stream("GET", "/v1/telemetry"))
                  for _ in range(MAX_STREAMS_PER_TOKEN)]
        assert {r.status_code for r in opened} == {200}
        over = a.get("/v1/telemetry")
        assert (over.status_code, over.json()["code"]) == (429, "too_many_requests")
        with b.stream("GET", "/v1/telemetry") as other:  # another token is not held back
            assert other.status_code == 200
        opened[0].close()

        def reopened() -> bool:
            with a.stream("GET", "/v1/telemetry") as again:
                return again.status_code == 200

        assert wait_for(reopened, timeout=10, every=0.2)


def test_the_dashboards_streams_count_against_the_tokens_open_streams(stack: Stack) -> None:
    """The dashboard's live stream polls the views twice a second for as long as it is open:
    outside the token's cap, one token could open them without end."""
    from contextlib import ExitStack

    import msgspec

    from gateway.sse import MAX_STREAMS_PER_TOKEN
    from tests.gateway_stack import wait_for

    with stack.client("beta") as b, ExitStack() as held:
        def filled() -> bool:  # once the streams of the test before are let go
            attempt = ExitStack()
            opened = [attempt.enter_context(b.stream("GET", "/dashboard/stream"))
                      for _ in range(MAX_STREAMS_PER_TOKEN - 1)]
            opened.append(attempt.enter_context(b.stream("GET", "/v1/telemetry")))
            if [r.status_code for r in opened] == [200] * MAX_STREAMS_PER_TOKEN:
                held.push(attempt.pop_all())
                return True
            attempt.close()
            return False

        assert wait_for(filled, timeout=10, every=0.2)
        for path in ("/dashboard/stream", "/v1/telemetry"):  # one cap for both kinds
            with b.stream("GET", path) as over:
                assert over.status_code == 429, path
                assert msgspec.json.decode(over.read())["code"] == "too_many_requests"
        held.close()

        def reopened() -> bool:
            with b.stream("GET", "/dashboard/stream") as again:
                return again.status_code == 200

        assert wait_for(reopened, timeout=10, every=0.2)


def test_failed_token_checks_from_one_address_are_throttled_and_others_are_not(
        stack: Stack) -> None:
    """Past the failures an address may make, its requests are refused before any token is
    looked at (its own good token included), while another address's good token works."""
    import httpx

    from gateway.throttle import MAX_FAILED_LOGINS

    guesser = httpx.Client(base_url=stack.url, timeout=15,
                           transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with guesser, stack.client("alpha") as elsewhere:
        wrong = {"Authorization": "Bearer cpt_" + "x" * 43}
        codes = [guesser.get("/v1/compute-leases", headers=wrong).status_code
                 for _ in range(MAX_FAILED_LOGINS)]
        assert set(codes) == {401}
        for headers in (wrong, {"Authorization": f"Bearer {stack.tokens['alpha']}"}):
            r = guesser.get("/v1/compute-leases", headers=headers)
            assert (r.status_code, r.json()["code"]) == (429, "login_throttled")
            assert 1 <= int(r.headers["Retry-After"]) <= 60
            assert r.json()["reasons"]["max_failed_logins"] == MAX_FAILED_LOGINS
        r = guesser.post("/login", data={"token": stack.tokens["alpha"]})  # the dashboard's form
        assert (r.status_code, r.json()["code"]) == (429, "login_throttled")
        assert elsewhere.get("/v1/compute-leases").status_code == 200
