"""The image policy: reference parsing, each reason code, signatures with real keys, and
admission through the command service against a real nats-server (refusals append nothing)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import assume, given
from hypothesis import strategies as st

from bus.local.server import NatsServer
from cli.image_signing import generate_key_pair, sign_image
from cli.main import main
from client.api import PoolClient
from domain.errors import ImageNotAllowed, InvalidConfiguration
from domain.lease import JobSpec, Lease
from domain.policy.images import (
    ImagePolicy,
    InvalidReference,
    check_image,
    check_runtime,
    parse_reference,
    simple_signing_payload,
    verify_for_start,
)
from domain.pool import Pool
from domain.resources import NodeId, PoolId, Shape, TenantId
from tests.control_plane import FakeClock, lease_body, node_body, setup_pool, start
from workers.plane import ControlPlane

DIGEST = "sha256:" + "ab" * 32
OTHER_DIGEST = "sha256:" + "cd" * 32
IMAGE = f"ghcr.io/acme/train@{DIGEST}"
EC_PRIVATE, EC_PUBLIC = generate_key_pair("ecdsa-p256")
ED_PRIVATE, ED_PUBLIC = generate_key_pair("ed25519")
STRANGER_PRIVATE, _STRANGER_PUBLIC = generate_key_pair("ecdsa-p256")


def signed_policy(**overrides: Any) -> ImagePolicy:
    settings: dict[str, Any] = {
        "approved_registries": ("ghcr.io/acme", "127.0.0.1:5000"),
        "trusted_keys": (("release", EC_PUBLIC), ("ci", ED_PUBLIC)),
        "require_signature": True,
        "max_image_size_bytes": 10 * 2**30,
    }
    return ImagePolicy(**{**settings, **overrides})


# -- references --------------------------------------------------------------------------------


def test_a_bare_docker_hub_name_is_normalised() -> None:
    ref = parse_reference(f"busybox@{DIGEST}")
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (
        "docker.io", "library/busybox", None, DIGEST)
    assert ref.signing_identity == "index.docker.io/library/busybox"
    assert parse_reference("index.docker.io/busybox:1").name == "docker.io/library/busybox"


def test_a_registry_with_a_port_a_tag_and_a_digest_parse_apart() -> None:
    ref = parse_reference(f"127.0.0.1:5000/team/app:v1.2@{DIGEST}")
    assert ref.registry == "127.0.0.1:5000" and ref.repository == "team/app"
    assert ref.tag == "v1.2" and ref.digest == DIGEST and ref.is_digest_pinned
    assert str(ref) == f"127.0.0.1:5000/team/app:v1.2@{DIGEST}"
    assert parse_reference("localhost/app:1").registry == "localhost"
    assert parse_reference("Ghcr.IO/acme/x:1").registry == "ghcr.io"


@pytest.mark.parametrize("text", ["", "UPPER/case:1", "ghcr.io/acme//x", "ghcr.io/acme/x:",
                                  "ghcr.io/acme/x@sha256", "a" * 600, "x@", "ghcr.io/a/b:t@@d",
                                  "-leading/x"])
def test_a_malformed_reference_is_refused(text: str) -> None:
    with pytest.raises(InvalidReference):
        parse_reference(text)
    assert check_image(ImagePolicy(), text) == ["image_reference_invalid"]


_component = st.from_regex(r"[a-z0-9]{1,6}([._-][a-z0-9]{1,4}){0,2}", fullmatch=True)
_hosts = st.sampled_from(["ghcr.io", "127.0.0.1:5000", "localhost:8080", "registry.example.com",
                          "quay.io", None])


def _sha256_of(b: bytes) -> str:  # named: Hypothesis parses a lambda's source
    return "sha256:" + b.hex()


@given(host=_hosts, path=st.lists(_component, min_size=1, max_size=4),
       tag=st.none() | st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True),
       digest=st.none() | st.binary(min_size=32, max_size=32).map(_sha256_of))
def test_references_parse_to_their_parts_and_print_back(
    host: str | None, path: list[str], tag: str | None, digest: str | None
) -> None:
    assume(host is not None or "." not in path[0])  # a dotted first component is a registry
    text = "/".join(([host] if host else []) + path)
    text += f":{tag}" if tag else ""
    text += f"@{digest}" if digest else ""
    ref = parse_reference(text)
    repository = "/".join(path)
    if host is None and len(path) == 1:
        repository = f"library/{repository}"
    assert ref.registry == (host or "docker.io")
    assert (ref.repository, ref.tag, ref.digest) == (repository, tag, digest)
    assert ref.is_digest_pinned == (digest is not None)
    assert parse_reference(str(ref)) == ref  # the printed form is a fixed point


@given(st.text(max_size=80))
def test_any_text_parses_or_is_refused_with_invalid_reference(text: str) -> None:
    try:
        parse_reference(text)
    except InvalidReference:
        pass
    assert isinstance(check_image(signed_policy(), text), list)


# -- registries and digests ---------------------------------------------------------------------


def test_only_approved_registries_and_repository_prefixes_pass() -> None:
    policy = ImagePolicy(approved_registries=("ghcr.io/acme", "127.0.0.1:5000", "docker.io"))
    assert check_image(policy, IMAGE) == []
    assert check_image(policy, f"127.0.0.1:5000/any/thing@{DIGEST}") == []
    assert check_image(policy, f"busybox@{DIGEST}") == []  # docker.io/library/busybox
    for refused in (f"ghcr.io/acmecorp/x@{DIGEST}", f"ghcr.io/other/x@{DIGEST}",
                    f"evil.example/acme/train@{DIGEST}", f"127.0.0.1:5001/x@{DIGEST}"):
        assert check_image(policy, refused) == ["image_registry_not_approved"], refused


def test_a_tenants_own_list_replaces_the_pools() -> None:
    policy = ImagePolicy(approved_registries=("ghcr.io/acme",),
                         tenant_registries=(("beta", ("reg.beta.example",)),))
    assert check_image(policy, f"reg.beta.example/x@{DIGEST}", tenant="beta") == []
    assert check_image(policy, IMAGE, tenant="beta") == ["image_registry_not_approved"]
    assert check_image(policy, IMAGE, tenant="alpha") == []
    assert check_image(policy, f"reg.beta.example/x@{DIGEST}", tenant="alpha") == [
        "image_registry_not_approved"]


@pytest.mark.parametrize("image", ["ghcr.io/acme/train:latest", "ghcr.io/acme/train",
                                   "ghcr.io/acme/train@sha256:abc",
                                   "ghcr.io/acme/train@sha256:" + "AB" * 32,
                                   "ghcr.io/acme/train@sha512:" + "ab" * 64])
def test_a_reference_not_pinned_by_sha256_digest_is_refused(image: str) -> None:
    assert check_image(ImagePolicy(), image) == ["image_not_digest_pinned"]


def test_a_tag_next_to_the_digest_is_still_pinned() -> None:
    assert check_image(ImagePolicy(), f"ghcr.io/acme/train:v1@{DIGEST}") == []


# -- signatures ---------------------------------------------------------------------------------


def test_the_payload_is_cosigns_simple_signing_json() -> None:
    assert simple_signing_payload(f"busybox:1@{DIGEST}") == (
        '{"critical":{"identity":{"docker-reference":"index.docker.io/library/busybox"},'
        f'"image":{{"docker-manifest-digest":"{DIGEST}"}},'
        '"type":"cosign container image signature"},"optional":null}'
    ).encode()
    with pytest.raises(InvalidReference):
        simple_signing_payload("ghcr.io/acme/train:1")


@pytest.mark.parametrize("private", [EC_PRIVATE, ED_PRIVATE], ids=["ecdsa-p256", "ed25519"])
def test_a_signature_from_a_trusted_key_passes(private: str) -> None:
    signature = sign_image(private, IMAGE)
    assert check_image(signed_policy(), IMAGE, signature) == []
    assert check_image(signed_policy(), f"ghcr.io/acme/train:v9@{DIGEST}", signature) == []


def test_unsigned_wrongly_signed_and_tampered_images_are_refused() -> None:
    policy = signed_policy()
    good = sign_image(EC_PRIVATE, IMAGE)
    cases = {
        "unsigned": (IMAGE, None),
        "empty": (IMAGE, ""),
        "untrusted key": (IMAGE, sign_image(STRANGER_PRIVATE, IMAGE)),
        "other digest": (f"ghcr.io/acme/train@{OTHER_DIGEST}", good),
        "other repository": (f"ghcr.io/acme/eval@{DIGEST}", good),
        "not base64": (IMAGE, "not*base64"),
        "flipped bit": (IMAGE, base64.b64encode(
            bytes([base64.b64decode(good)[0] ^ 1]) + base64.b64decode(good)[1:]).decode()),
    }
    for name, (image, signature) in cases.items():
        assert check_image(policy, image, signature) == ["image_signature_invalid"], name


def test_the_signature_of_a_tag_only_reference_cannot_verify() -> None:
    assert check_image(signed_policy(), "ghcr.io/acme/train:1", sign_image(EC_PRIVATE, IMAGE)) == [
        "image_not_digest_pinned", "image_signature_invalid"]


def test_without_require_signature_an_unsigned_image_passes() -> None:
    assert check_image(signed_policy(require_signature=False), IMAGE, None) == []


# -- size and isolation --------------------------------------------------------------------------


def test_an_image_over_the_size_limit_is_refused() -> None:
    policy = ImagePolicy(max_image_size_bytes=1000)
    assert check_image(policy, IMAGE, size_bytes=1001) == ["image_too_large"]
    assert check_image(policy, IMAGE, size_bytes=1000) == []
    assert check_image(policy, IMAGE, size_bytes=None) == []  # the agent checks after the pull
    assert check_image(ImagePolicy(), IMAGE, size_bytes=2**40) == []


def test_marketplace_nodes_need_sandboxed_or_stronger() -> None:
    policy = ImagePolicy()
    assert check_runtime(policy, isolation="container", node_trust="marketplace") == [
        "runtime_not_allowed"]
    for isolation in ("sandboxed", "microvm", "dedicated-host"):
        assert check_runtime(policy, isolation=isolation, node_trust="marketplace") == []
    assert check_runtime(policy, isolation="container", node_trust="trusted") == []
    assert check_runtime(policy, isolation="container", node_trust="unheard-of") == [
        "runtime_not_allowed"]
    assert check_runtime(policy, isolation="vm-ish", node_trust="trusted") == [
        "runtime_not_allowed"]


def test_untrusted_tenants_need_their_class_on_any_node() -> None:
    policy = ImagePolicy(untrusted_tenants=("mallory",), untrusted_tenant_isolation="microvm")
    assert check_runtime(policy, isolation="sandboxed", node_trust="trusted",
                         tenant="mallory") == ["runtime_not_allowed"]
    assert check_runtime(policy, isolation="sandboxed", tenant="mallory") == [
        "runtime_not_allowed"]  # no node yet: the tenant alone already refuses
    assert check_runtime(policy, isolation="microvm", node_trust="marketplace",
                         tenant="mallory") == []
    assert check_runtime(policy, isolation="container", node_trust="trusted",
                         tenant="alice") == []
    assert policy.allowed_trust_levels(isolation="sandboxed", tenant="alice") == (
        "trusted", "marketplace")
    assert policy.allowed_trust_levels(isolation="container", tenant="alice") == ("trusted",)
    assert policy.allowed_trust_levels(isolation="sandboxed", tenant="mallory") == ()


def test_the_marketplace_requirement_is_configurable() -> None:
    policy = ImagePolicy(isolation_by_trust=(("trusted", "container"), ("marketplace", "microvm")))
    assert check_runtime(policy, isolation="sandboxed", node_trust="marketplace") == [
        "runtime_not_allowed"]


def test_every_reason_is_reported_at_once_in_a_stable_order() -> None:
    policy = signed_policy(max_image_size_bytes=10)
    assert check_image(policy, "evil.example/x:latest", None, 11, "alpha",
                       node_trust="marketplace", isolation="container") == [
        "image_registry_not_approved", "image_not_digest_pinned", "image_signature_invalid",
        "image_too_large", "runtime_not_allowed"]


# -- the agent's check -----------------------------------------------------------------------------


def test_the_agent_checks_the_shipped_policy_dict() -> None:
    shipped = json.loads(json.dumps(signed_policy().to_dict()))  # as it travels in a command
    signature = sign_image(ED_PRIVATE, IMAGE)
    assert verify_for_start(shipped, IMAGE, signature, 5 * 2**30, "trusted", "container") == []
    assert verify_for_start(shipped, IMAGE, signature, 11 * 2**30, "trusted", "container") == [
        "image_too_large"]
    assert verify_for_start(shipped, IMAGE, None, None, "marketplace", "container") == [
        "image_signature_invalid", "runtime_not_allowed"]
    assert ImagePolicy.from_dict(shipped) == signed_policy()
    assert verify_for_start(shipped, None, None, None, "trusted", "container") == []  # no image
    assert verify_for_start(shipped, "", None, None, "marketplace", "container") == [
        "runtime_not_allowed"]


@pytest.mark.parametrize("broken", [{"trusted_keys": 5}, {"max_image_size_bytes": "big"},
                                    {"isolation_by_trust": {"trusted": "nothing"}},
                                    {"trusted_keys": {"k": "not a pem"}}])
def test_a_policy_that_does_not_load_refuses_everything(broken: dict[str, Any]) -> None:
    shipped = {**ImagePolicy().to_dict(), **broken}
    assert verify_for_start(shipped, IMAGE, None, None, "trusted", "container") == [
        "image_policy_invalid"]


# -- the policy as configuration -------------------------------------------------------------------


def test_inconsistent_policies_name_each_problem() -> None:
    rsa_pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).public_key(
    ).public_bytes(serialization.Encoding.PEM,
                   serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    problems = ImagePolicy(
        approved_registries=("https://ghcr.io",), trusted_keys=(("rsa", rsa_pem),),
        max_image_size_bytes=0, isolation_by_trust=(("trusted", "container"),),
        untrusted_tenant_isolation="vm",
    ).problems()
    assert len(problems) == 5, problems
    assert ImagePolicy(require_signature=True).problems() == [
        "require_signature needs at least one trusted key"]
    assert signed_policy().problems() == [] and ImagePolicy().problems() == []


def test_a_pool_versions_its_image_policy_by_event() -> None:
    pool = Pool.create(pool_id=PoolId("p"), now=1.0)
    assert pool.image_policy == ImagePolicy() and pool.image_policy_version == 1
    assert pool.set_image_policy(signed_policy(), 2.0) == 2
    assert [type(e).__name__ for e in pool.collect_events()][-1] == "ImagePolicySet"
    with pytest.raises(InvalidConfiguration):
        pool.set_image_policy(ImagePolicy(require_signature=True), 3.0)
    with pytest.raises(ImageNotAllowed) as refused:
        pool.admit_image("ghcr.io/acme/train:1", tenant="alpha")
    assert refused.value.code == "image_not_allowed"
    assert refused.value.reasons == ("image_not_digest_pinned", "image_signature_invalid")
    pool.admit_image(IMAGE, signature=sign_image(EC_PRIVATE, IMAGE), node_trust="trusted",
                     isolation="container")


def test_a_job_spec_stored_before_signatures_still_loads() -> None:
    old = {"image": "x", "command": ["true"], "env": {}, "checkpoint_interval_seconds": 0,
           "checkpoint_path": None}
    spec = JobSpec.from_dict(old)
    assert spec.image_signature is None and spec.image_size_bytes is None
    assert JobSpec.from_dict(spec.to_dict()) == spec


def test_the_start_command_carries_the_policy_and_signature_the_agent_checks() -> None:
    from schemas import v1
    from schemas.codec import decode
    from workers.dispatcher import orders_for

    pool = Pool.create(pool_id=PoolId("p"), now=1.0)
    pool.set_image_policy(signed_policy(untrusted_tenants=("acme",)), 2.0)
    lease = Lease.request(tenant_id=TenantId("acme"), pool_id=PoolId("p"), idempotency_key="k",
                          shape=Shape.build(cpu_millis=1000, memory_mib=512, runtime="sandboxed"),
                          maximum_runtime_seconds=600, now=3.0)
    lease.queue(4.0)
    lease.reserve(5.0, node_id=NodeId("n1"), commit_timeout_seconds=30, hold_microcredits=0)
    lease.commit(6.0, JobSpec(image=IMAGE, command=("true",), image_size_bytes=2**20,
                              image_signature=sign_image(ED_PRIVATE, IMAGE)))
    (order,) = orders_for("LeaseCommitted", lease, pool)
    start = decode(v1.LeaseAssignment, order.body)
    assert start.image_policy == pool.image_policy.to_dict()
    assert start.job.image_signature is not None and start.job.image_size_bytes == 2**20
    verdict = verify_for_start(start.image_policy, start.job.image or "", start.job.image_signature,
                               start.job.image_size_bytes, "trusted", start.shape.runtime,
                               tenant=start.tenant)
    assert verdict == []
    assert verify_for_start(start.image_policy, start.job.image or "", None, None, "trusted",
                            "container", tenant=start.tenant) == [
        "image_signature_invalid", "runtime_not_allowed"]


# -- admission through the command service ----------------------------------------------------------

Plane = tuple[ControlPlane, PoolClient, PoolClient, FakeClock]


@pytest.fixture()
def plane(fresh_nats: NatsServer) -> Iterator[Plane]:
    clock = FakeClock()
    cp = start(fresh_nats.url, clock)
    admin = PoolClient(fresh_nats.url)
    alpha = PoolClient(fresh_nats.url, "alpha")
    setup_pool(admin, tenants={"alpha": 1.0})
    assert admin.admin("node.register", node_body("n1"))["ok"]
    yield cp, admin, alpha, clock
    alpha.close()
    admin.close()
    cp.stop()


def _events(cp: ControlPlane) -> int:
    return cp.app.recorder.max_notification_id() or 0


def _policy_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "pool_id": "p1",
        "approved_registries": ["ghcr.io/acme"],
        "trusted_keys": [{"key_id": "release", "public_key_pem": EC_PUBLIC},
                         {"key_id": "ci", "public_key_pem": ED_PUBLIC}],
        "require_signature": True,
        "max_image_size_bytes": 2**30,
    }
    return {**body, **overrides}


def _reserved(cp: ControlPlane, alpha: PoolClient, key: str, **shape: Any) -> str:
    r = alpha.request_lease(lease_body(key, **shape))
    assert r["ok"], r
    assert cp.scheduler.cycle().placed == 1
    lid: str = r["lease"]["lease_id"]
    assert alpha.lease(lid, "get")["lease"]["state"] == "reserved"
    return lid


def test_pool_show_prints_the_image_policy_in_force(plane: Plane) -> None:
    _cp, admin, _alpha, _clock = plane
    shown = admin.admin("pool.show", {"pool_id": "p1"})["result"]
    assert shown["image_policy_version"] == 1
    assert shown["image_policy"] == ImagePolicy().to_dict()
    assert shown["image_policy"]["isolation_by_trust"] == {"marketplace": "sandboxed",
                                                           "trusted": "container"}
    r = admin.admin("pool.images", _policy_body(isolation_by_trust={"marketplace": "microvm"}))
    assert r["ok"], r
    assert r["result"]["image_policy_version"] == 2
    policy = r["result"]["image_policy"]
    assert policy["approved_registries"] == ["ghcr.io/acme"] and policy["require_signature"]
    assert policy["trusted_keys"] == {"release": EC_PUBLIC, "ci": ED_PUBLIC}
    assert policy["isolation_by_trust"] == {"marketplace": "microvm", "trusted": "container"}


def test_a_bad_image_policy_is_refused_and_appends_nothing(plane: Plane) -> None:
    cp, admin, _alpha, _clock = plane
    before = _events(cp)
    for body, code in [
        (_policy_body(trusted_keys=[]), "invalid_configuration"),
        (_policy_body(approved_registries=["https://ghcr.io"]), "invalid_field"),
        (_policy_body(registries=["ghcr.io"]), "unknown_field"),
        (_policy_body(max_image_size_bytes=0), "invalid_field"),
        (_policy_body(isolation_by_trust={"trusted": "vm"}), "invalid_field"),
        (_policy_body(trusted_keys=[{"key_id": "k", "public_key_pem": EC_PUBLIC}] * 2),
         "invalid_field"),
        (_policy_body(pool_id="nope"), "unknown_pool"),
    ]:
        r = admin.admin("pool.images", body)
        assert not r["ok"] and r["error"]["code"] == code, (body, r)
    assert _events(cp) == before


REFUSED_JOBS: list[tuple[dict[str, Any], set[str]]] = [
    ({"image": "ghcr.io/acme/train:latest"}, {"image_not_digest_pinned", "image_signature_invalid"}),
    ({"image": f"docker.io/evil/x@{DIGEST}",
      "image_signature": sign_image(EC_PRIVATE, f"docker.io/evil/x@{DIGEST}")},
     {"image_registry_not_approved"}),
    ({"image": IMAGE}, {"image_signature_invalid"}),
    ({"image": IMAGE, "image_signature": sign_image(STRANGER_PRIVATE, IMAGE)},
     {"image_signature_invalid"}),
    ({"image": f"ghcr.io/acme/train@{OTHER_DIGEST}",
      "image_signature": sign_image(EC_PRIVATE, IMAGE)}, {"image_signature_invalid"}),
    ({"image": IMAGE, "image_signature": sign_image(EC_PRIVATE, IMAGE),
      "image_size_bytes": 2**30 + 1}, {"image_too_large"}),
]


def test_a_commit_with_a_refused_image_is_refused_and_appends_nothing(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("pool.images", _policy_body())["ok"]
    lid = _reserved(cp, alpha, "bad-image")
    before = _events(cp)
    for job, reasons in REFUSED_JOBS:
        r = alpha.lease(lid, "commit", {"job": {**job, "command": ["true"]}})
        assert not r["ok"], r
        assert r["error"]["code"] == "image_not_allowed"
        assert set(r["error"]["reasons"]) == reasons, job
    assert _events(cp) == before
    assert alpha.lease(lid, "get")["lease"]["state"] == "reserved"


def test_a_commit_with_a_signed_approved_image_runs(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("pool.images", _policy_body())["ok"]
    for name, private in (("ecdsa", EC_PRIVATE), ("ed25519", ED_PRIVATE)):
        lid = _reserved(cp, alpha, f"good-{name}")
        job = {"image": IMAGE, "image_signature": sign_image(private, IMAGE),
               "image_size_bytes": 2**20, "command": ["true"]}
        r = alpha.lease(lid, "commit", {"job": job})
        assert r["ok"], r
        assert r["lease"]["state"] == "running"
        stored = cp.app.get("alpha", lid).job
        assert stored is not None and stored.spec.image_signature == job["image_signature"]
        assert stored.spec.image_size_bytes == 2**20


def test_a_container_on_a_marketplace_node_is_refused_at_commit(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("node.n1.cordon", {})["ok"]
    assert admin.admin("node.register", node_body(
        "m1", trust_level="marketplace", runtimes=["container", "sandboxed"]))["ok"]
    # the scheduler itself keeps containers off marketplace nodes under the default policy, so
    # place one while the policy allows it, then tighten the policy before the commit
    assert admin.admin("pool.images", {"pool_id": "p1", "isolation_by_trust": {
        "marketplace": "container", "trusted": "container"}})["ok"]
    lid = _reserved(cp, alpha, "on-marketplace")
    assert alpha.lease(lid, "get")["lease"]["node_id"] == "m1"
    assert admin.admin("pool.images", {"pool_id": "p1"})["ok"]  # marketplace: sandboxed
    before = _events(cp)
    r = alpha.lease(lid, "commit", {"job": {"image": IMAGE, "command": ["true"]}})
    assert not r["ok"] and r["error"]["code"] == "image_not_allowed", r
    assert r["error"]["reasons"] == {"runtime_not_allowed": 1}
    assert _events(cp) == before
    sandboxed = _reserved(cp, alpha, "sandboxed-on-marketplace", runtime="sandboxed")
    r = alpha.lease(sandboxed, "commit", {"job": {"image": IMAGE, "command": ["true"]}})
    assert r["ok"] and r["lease"]["state"] == "running", r


def test_a_request_naming_a_refused_image_is_refused_and_appends_nothing(plane: Plane) -> None:
    cp, admin, alpha, _clock = plane
    assert admin.admin("pool.images", _policy_body(untrusted_tenants=["alpha"]))["ok"]
    before = _events(cp)
    r = alpha.request_lease({**lease_body("tagged"), "image": "ghcr.io/acme/train:1"})
    assert not r["ok"] and r["error"]["code"] == "image_not_allowed", r
    assert set(r["error"]["reasons"]) == {"image_not_digest_pinned", "image_signature_invalid",
                                          "runtime_not_allowed"}
    signed = {"image": IMAGE, "image_signature": sign_image(EC_PRIVATE, IMAGE)}
    r = alpha.request_lease({**lease_body("container"), **signed})
    assert r["error"]["reasons"] == {"runtime_not_allowed": 1}  # alpha is untrusted
    r = alpha.request_lease({**lease_body("big", runtime="sandboxed"), **signed,
                             "image_size_bytes": 2**31})
    assert r["error"]["reasons"] == {"image_too_large": 1}
    assert _events(cp) == before
    r = alpha.request_lease({**lease_body("fine", runtime="sandboxed"), **signed})
    assert r["ok"] and r["lease"]["state"] == "queued", r


def test_the_cli_sets_keys_signs_and_commits(
    plane: Plane, fresh_nats: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cp, _admin, alpha, _clock = plane
    url = ["--nats-url", fresh_nats.url]
    prefix = tmp_path / "release"
    assert main(["image", "keygen", str(prefix), "--kind", "ed25519"]) == 0
    assert (prefix.with_suffix(".key").stat().st_mode & 0o777) == 0o600
    capsys.readouterr()
    assert main(["admin", "pool", "images", "p1", "--registry", "ghcr.io/acme",
                 "--key-file", f"{prefix}.pub", "--require-signature",
                 "--max-image-size", "1000000", "--isolation", "marketplace=microvm",
                 "--untrusted-tenant", "mallory", "--json", *url]) == 0
    policy = json.loads(capsys.readouterr().out)["result"]["image_policy"]
    assert list(policy["trusted_keys"]) == ["release"] and policy["require_signature"]
    assert policy["isolation_by_trust"]["marketplace"] == "microvm"
    assert policy["untrusted_tenants"] == ["mallory"]
    assert main(["admin", "pool", "show", "p1", *url]) == 0
    assert "image_policy" in capsys.readouterr().out
    assert main(["image", "sign", IMAGE, "--key", f"{prefix}.key"]) == 0
    signature = capsys.readouterr().out.strip()
    lid = _reserved(cp, alpha, "cli")
    assert main(["lease", "commit", lid, "--tenant", "alpha", "--image", IMAGE,
                 "--cmd", "true", *url]) == 1
    assert "image_not_allowed" in capsys.readouterr().err
    assert main(["lease", "commit", lid, "--tenant", "alpha", "--image", IMAGE,
                 "--image-signature", signature, "--image-size", "1000", "--cmd", "true",
                 "--json", *url]) == 0
    assert json.loads(capsys.readouterr().out)["lease"]["state"] == "running"

