"""The rules of secrets without a server: the key ring seals under its first key and opens
with any key it holds, a sealed value opens only where it belongs, a job names secrets and
the log keeps names and versions only."""

from __future__ import annotations

import msgspec
import pytest

from agents.runtimes.contract import WorkloadError, WorkloadSpec
from domain.lease import JobSpec
from schemas import v1
from schemas.codec import COMMANDS, SchemaError, decode_with
from workers.sealing import BadKeyRing, KeyRing, Unreadable


def test_a_ring_seals_under_its_first_key_and_opens_with_any_it_holds() -> None:
    old = KeyRing.parse("k1=old", purpose="job secrets")
    key_id, sealed = old.seal(b"value", context="alpha/tok/1")
    assert key_id == "k1"
    rotated = KeyRing.parse("k2=new,k1=old", purpose="job secrets")
    assert rotated.open(key_id, sealed, context="alpha/tok/1") == b"value"
    assert rotated.seal(b"value", context="alpha/tok/2")[0] == "k2"
    with pytest.raises(Unreadable):  # the old key dropped: what it sealed no longer opens
        KeyRing.parse("k2=new", purpose="job secrets").open(key_id, sealed,
                                                            context="alpha/tok/1")


def test_a_sealed_value_opens_only_for_its_tenant_name_and_version() -> None:
    ring = KeyRing.parse("k1=x", purpose="job secrets")
    key_id, sealed = ring.seal(b"value", context="alpha/tok/1")
    for elsewhere in ("beta/tok/1", "alpha/other/1", "alpha/tok/2"):
        with pytest.raises(Unreadable):
            ring.open(key_id, sealed, context=elsewhere)
    tampered = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    with pytest.raises(Unreadable):
        ring.open(key_id, tampered, context="alpha/tok/1")
    # and another purpose stretches the same text to another key
    other = KeyRing.parse("k1=x", purpose="webhook secrets")
    with pytest.raises(Unreadable):
        other.open(key_id, sealed, context="alpha/tok/1")


@pytest.mark.parametrize("text", ["", "k1", "k1=", "K1=x", "k1=a,k1=b", "=x"])
def test_a_malformed_ring_is_refused(text: str) -> None:
    with pytest.raises(BadKeyRing):
        KeyRing.parse(text, purpose="job secrets")


def _commit(job: dict[str, object]) -> v1.CommitLease:
    cmd = decode_with(COMMANDS["lease.commit"], msgspec.json.encode({"job": job}))
    assert isinstance(cmd, v1.CommitLease)
    return cmd


@pytest.mark.parametrize("job", [
    {"command": ["x"], "env": {"T": "1"}, "secret_env": {"T": "tok"}},  # shadows a plain one
    {"command": ["x"], "secret_env": {"POOL_TENANT": "tok"}},  # shadows the pool's
    {"command": ["x"], "secret_files": {"a": "/run/secrets/f", "b": "/run/secrets/f"}},
    {"command": ["x"], "secret_files": {"a": "/etc/passwd"}},
    {"command": ["x"], "secret_files": {"a": "/run/secrets/../x"}},
    {"command": ["x"], "secret_files": {"a": "/run/secrets/.."}},
    {"command": ["x"], "secret_env": {"T": "Not.A.Name"}},
])
def test_a_job_naming_secrets_badly_is_refused(job: dict[str, object]) -> None:
    with pytest.raises(SchemaError):
        _commit(job)


def test_the_log_keeps_a_jobs_secret_names_and_versions_only() -> None:
    spec = JobSpec(image="", command=("x",), secret_env=(("T", "tok"),),
                   secret_files=(("key", "/run/secrets/key"),),
                   secret_versions=(("tok", 3), ("key", 1)))
    d = spec.to_dict()
    assert d["secrets"] == {"env": {"T": "tok"}, "files": {"key": "/run/secrets/key"},
                            "versions": {"key": 1, "tok": 3}}
    assert JobSpec.from_dict(d) == spec
    # a job without secrets records the same event as before they existed
    assert "secrets" not in JobSpec(image="", command=("x",)).to_dict()


def test_a_workload_never_shows_its_secrets_in_a_repr() -> None:
    spec = WorkloadSpec(lease_id="l", epoch=1, job_number=1, command=("x",),
                        secret_env=(("T", "hunter2"),), secret_files=(("/run/secrets/k",
                                                                       b"hunter3"),))
    assert "hunter" not in repr(spec)


def test_a_registry_secret_is_a_user_and_a_password_or_refused_without_its_value() -> None:
    from agents.secrets import registry_auth

    assert registry_auth("reg", b"puller:pa:ss\n") == ("puller", "pa:ss")
    for bad in (b"no-colon", b":nouser", b"puller:", b"u:p\nmore", b"\xff:x"):
        with pytest.raises(WorkloadError) as e:
            registry_auth("reg", bad)
        assert e.value.code == "registry_secret_malformed" and "reg" in str(e.value)
        assert bad.decode(errors="replace") not in str(e.value)


def test_a_pull_the_registry_refuses_for_want_of_credentials_has_its_own_code() -> None:
    from agents.runtimes.docker import pull_refusal

    assert pull_refusal("Head \"http://127.0.0.1:5000/v2/x/manifests/sha256:1\": no basic "
                        "auth credentials") == "registry_unauthorized"
    assert pull_refusal("unauthorized: authentication required") == "registry_unauthorized"
    assert pull_refusal("manifest unknown") == "image_pull_failed"


def test_the_log_names_a_jobs_registry_secret_and_a_job_without_one_records_as_before() -> None:
    plain = JobSpec(image="i", command=("c",), secret_env=(("T", "tok"),),
                    secret_versions=(("tok", 1),))
    assert "registry" not in plain.to_dict()["secrets"]
    private = JobSpec(image="i", command=("c",), registry_secret="reg",
                      secret_versions=(("reg", 2),))
    assert private.to_dict()["secrets"]["registry"] == "reg"
    assert JobSpec.from_dict(private.to_dict()) == private
    assert JobSpec.from_dict(plain.to_dict()) == plain
