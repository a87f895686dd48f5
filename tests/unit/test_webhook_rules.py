"""Webhooks without a server: the Standard Webhooks signature (the specification's own example),
which addresses are refused, the endpoint rules, sealed secrets and the retry schedule."""

from __future__ import annotations

import pytest

from domain.errors import InvalidWebhook, WebhookLimit
from domain.webhook import WebhookEndpoints
from workers.errors import WebhookAddressRefused
from workers.webhooks.addresses import networks, resolve
from workers.webhooks.settings import WebhookSettings
from workers.webhooks.signing import (
    SealedSecretUnreadable,
    new_secret,
    plane_key,
    seal,
    signature,
    unseal,
)


def test_the_signature_is_the_standard_webhooks_example() -> None:
    # the example in the Standard Webhooks specification and its reference libraries
    assert signature("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek",
                     1614265330, b'{"test": 2432232314}') == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert new_secret().startswith("whsec_") and new_secret() != new_secret()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/", "http://10.0.0.1/", "http://172.16.5.4/", "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data", "http://100.64.0.1/", "http://0.0.0.0/",
    "http://[::1]/", "http://[fe80::1]/", "http://[fd00::1]/", "http://[::ffff:127.0.0.1]/",
    "http://224.0.0.1/", "http://240.0.0.1/"])
def test_an_address_that_is_not_global_is_refused(url: str) -> None:
    with pytest.raises(WebhookAddressRefused):
        resolve(url)


def test_an_operator_allows_a_network_of_its_own() -> None:
    assert resolve("http://127.0.0.1:8080/h", networks("127.0.0.1/32"))[2] == ["127.0.0.1"]
    assert resolve("https://93.184.215.14/")[1:] == (443, ["93.184.215.14"])
    with pytest.raises(WebhookAddressRefused):
        resolve("http://127.0.0.2/", networks("127.0.0.1/32"))


def test_endpoint_rules() -> None:
    book = WebhookEndpoints.open(tenant_id="t", now=1.0)
    e = book.add(endpoint_id="a", url="https://h.example/x", events=["ended", "running", "ended"],
                 sealed_secret="v1:…", after_seq=7, now=2.0, most=1)
    assert e.events == ("ended", "running")
    assert e.wants("released") and e.wants("cancelled") and e.wants("running")
    assert not e.wants("queued")
    assert "sealed_secret" not in e.to_dict()
    with pytest.raises(WebhookLimit):
        book.add(endpoint_id="b", url="https://h.example/y", events=["ended"], sealed_secret="",
                 after_seq=0, now=3.0, most=1)
    for url, events in (("ftp://h.example/", ["ended"]), ("http://u:p@h.example/", ["ended"]),
                        ("https://h.example/", ["finished"]), ("https://h.example/", [])):
        with pytest.raises(InvalidWebhook):
            WebhookEndpoints.open(tenant_id="t", now=0).add(
                endpoint_id="c", url=url, events=events, sealed_secret="", after_seq=0, now=0,
                most=5)


def test_a_sealed_secret_opens_only_for_its_endpoint_under_its_key() -> None:
    key = plane_key("k")
    sealed = seal(key, "whsec_abc", context="t.a")
    assert "whsec_abc" not in sealed and unseal(key, sealed, context="t.a") == "whsec_abc"
    for other_key, context in ((plane_key("other"), "t.a"), (key, "t.b")):
        with pytest.raises(SealedSecretUnreadable):
            unseal(other_key, sealed, context=context)


def test_retries_back_off_exponentially_to_a_ceiling() -> None:
    s = WebhookSettings()
    assert [s.backoff(n) for n in (1, 2, 3, 4)] == [5.0, 10.0, 20.0, 40.0]
    assert s.backoff(30) == 3600.0 and s.give_up_seconds == 86400.0
