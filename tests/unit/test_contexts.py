"""Saved contexts (client/contexts.py) and which transport a tenant command takes (cli/connect)."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from cli.connect import context_of
from cli.output import UsageError
from client import contexts
from client.contexts import Config, Context


def _ctx(name: str, tenant: str = "alpha") -> Context:
    return Context(name=name, url="http://127.0.0.1:8080", token=f"cpt_{name}", tenant=tenant,
                   pool="p1")


def test_a_config_survives_a_save_and_load_private_and_whole(tmp_path: Path) -> None:
    path = tmp_path / "computepool" / "config.toml"
    odd = Context(name="odd.1", url='http://h:1/a"b\\c', token="cpt_\u00e9\U0001f600\n",
                  tenant="alpha", pool="")
    config = Config().with_context(_ctx("lab")).with_context(odd, use=False)
    contexts.save(config, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]  # no temporary left
    assert contexts.load(path) == config
    assert contexts.load(path).pick(None) == _ctx("lab")


def test_deleting_the_current_context_leaves_none_current() -> None:
    config = Config().with_context(_ctx("a")).with_context(_ctx("b"))
    assert config.without("b").current == "" and config.without("a").current == "b"
    with pytest.raises(contexts.UnknownContext):
        config.without("zz")


def test_a_broken_file_is_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("current-context = [\n")
    with pytest.raises(contexts.BadConfig):
        contexts.load(path)


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"context": None, "nats_url": None, **kw})


def test_the_transport_is_picked_flag_first_then_variables_then_the_current_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    for name in ("POOL_NATS_URL", "POOL_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    assert context_of(_args()) is None  # nothing saved: NATS, as before
    contexts.save(Config().with_context(_ctx("a")).with_context(_ctx("b", "beta")))
    assert context_of(_args()).name == "b"
    assert context_of(_args(nats_url="nats://x")) is None
    assert context_of(_args(nats_url="nats://x", context="a")).name == "a"
    monkeypatch.setenv("POOL_NATS_URL", "nats://x")
    assert context_of(_args()) is None
    assert context_of(_args(context="a")).name == "a"
    monkeypatch.delenv("POOL_NATS_URL")
    monkeypatch.setenv("POOL_CONTEXT", "a")
    assert context_of(_args()).name == "a"
    monkeypatch.setenv("POOL_CONTEXT", "zz")
    with pytest.raises(UsageError, match="POOL_CONTEXT"):
        context_of(_args())


def test_the_clients_view_filters_are_the_gateways() -> None:
    from client.http import VIEW_FILTERS
    from gateway.routes import LEASE_FILTERS, QUEUE_FILTERS

    assert VIEW_FILTERS == {"leases": LEASE_FILTERS, "queue": QUEUE_FILTERS, "balance": ()}
