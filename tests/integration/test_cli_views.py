"""The view commands (`pool queue|balance|capacity|leases`) check what they are asked for and
answer with a typed error, never a raw database error."""

from __future__ import annotations

import psycopg
import pytest

from cli.main import main
from projections.errors import BadQuery
from projections.queries import query
from projections.views import create_schema


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture()
def views(database_url: str, schema: str) -> list[str]:
    with psycopg.connect(database_url) as conn:
        create_schema(conn, schema)
    return ["--database-url", database_url, "--schema", schema]


def test_asking_the_capacity_view_for_a_tenant_is_refused_in_the_query_layer(
    database_url: str, schema: str, views: list[str]
) -> None:
    with psycopg.connect(database_url) as conn, pytest.raises(BadQuery, match="tenant"):
        query(conn, "capacity", tenant="acme", schema=schema)


def test_a_view_command_offers_the_tenant_flag_only_on_tenant_views(
    views: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(capsys, "leases", "--tenant", "acme", *views)[0] == 0
    rc, out, err = _run(capsys, "capacity", "--tenant", "acme", *views)
    assert rc == 2 and out == "" and "--tenant" in err and "UndefinedColumn" not in err


@pytest.mark.parametrize(("argv", "flag"), [
    (("leases", "--limit", "-5"), "--limit"),
    (("leases", "--limit", "0"), "--limit"),
    (("queue", "--filter", "state"), "--filter"),
    (("capacity", "--filter", "tenant=acme"), "--filter"),
    (("leases", "--filter", "state=a\x00b"), "--filter"),
])
def test_a_bad_view_filter_is_one_line_naming_the_flag(
    views: list[str], capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], flag: str
) -> None:
    rc, out, err = _run(capsys, *argv, *views)
    assert rc == 2 and out == ""
    assert flag in err.splitlines()[0] and len(err.splitlines()) <= 2, err


def test_views_that_are_not_built_yet_are_a_typed_error(
    database_url: str, schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _run(capsys, "leases", "--database-url", database_url, "--schema", schema)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "[views_unavailable]" in err, err
