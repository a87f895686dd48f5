"""Image policy: which images a pool lets run and how isolated they must be (pure checks).

Reason codes, the signature format and the agent's check: docs/image-policy.md.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from domain.resources import RUNTIME_CLASSES, TRUST_LEVELS

# Reason codes ---------------------------------------------------------------------------------

IMAGE_REFERENCE_INVALID = "image_reference_invalid"
IMAGE_REGISTRY_NOT_APPROVED = "image_registry_not_approved"
IMAGE_NOT_DIGEST_PINNED = "image_not_digest_pinned"
IMAGE_SIGNATURE_INVALID = "image_signature_invalid"
IMAGE_TOO_LARGE = "image_too_large"
RUNTIME_NOT_ALLOWED = "runtime_not_allowed"
IMAGE_POLICY_INVALID = "image_policy_invalid"
REASON_CODES: tuple[str, ...] = (
    IMAGE_REFERENCE_INVALID, IMAGE_REGISTRY_NOT_APPROVED, IMAGE_NOT_DIGEST_PINNED,
    IMAGE_SIGNATURE_INVALID, IMAGE_TOO_LARGE, RUNTIME_NOT_ALLOWED, IMAGE_POLICY_INVALID,
)

ANY_REGISTRY = "*"
DOCKER_HUB = "docker.io"  # how references and registry lists name Docker Hub
_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
_COSIGN_DOCKER_HUB = "index.docker.io"  # how cosign's docker-reference names it
COSIGN_SIGNATURE_TYPE = "cosign container image signature"
# Strength order of isolation classes, weakest first (domain.resources lists them so).
ISOLATION_ORDER: tuple[str, ...] = RUNTIME_CLASSES


# References -----------------------------------------------------------------------------------

# distribution/reference's grammar, lower-case path components, one optional port.
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_HOST = re.compile(
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"|\[[0-9a-fA-F:]+\])(?::[0-9]{1,5})?"
)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+")
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
MAX_REFERENCE_LENGTH = 512


class InvalidReference(ValueError):
    """The text is not an OCI image reference."""


@dataclass(frozen=True)
class ImageReference:
    """A parsed image reference: `registry/repository[:tag][@digest]`, Docker Hub normalised."""

    registry: str  # host[:port], lower-cased; "docker.io" for Docker Hub
    repository: str  # "library/busybox" for a bare Docker Hub name
    tag: str | None = None
    digest: str | None = None  # "algorithm:hex" as written

    @property
    def name(self) -> str:
        """`registry/repository`, the part registry lists are matched against."""
        return f"{self.registry}/{self.repository}"

    @property
    def is_digest_pinned(self) -> bool:
        """Pinned by an immutable sha256 digest (a tag next to it is ignored by pullers)."""
        return self.digest is not None and _SHA256.fullmatch(self.digest) is not None

    @property
    def signing_identity(self) -> str:
        """The `docker-reference` cosign puts in its payload for this repository."""
        host = _COSIGN_DOCKER_HUB if self.registry == DOCKER_HUB else self.registry
        return f"{host}/{self.repository}"

    def __str__(self) -> str:
        out = self.name
        if self.tag is not None:
            out += f":{self.tag}"
        if self.digest is not None:
            out += f"@{self.digest}"
        return out


def parse_reference(text: str) -> ImageReference:
    """Parse an OCI image reference; raises InvalidReference naming what is wrong."""
    if not isinstance(text, str) or not text or len(text) > MAX_REFERENCE_LENGTH:
        raise InvalidReference("an image reference is 1 to 512 characters")
    rest, digest = text, None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise InvalidReference(f"bad digest {digest!r}")
    tag = None
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        rest, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.fullmatch(tag):
            raise InvalidReference(f"bad tag {tag!r}")
    first, sep, remainder = rest.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        if not _HOST.fullmatch(first):
            raise InvalidReference(f"bad registry host {first!r}")
        registry, path = first.lower(), remainder
    else:
        registry, path = DOCKER_HUB, rest
    if registry in _DOCKER_HUB_ALIASES:
        registry = DOCKER_HUB
        if "/" not in path:
            path = f"library/{path}"
    components = path.split("/")
    if not path or not all(_PATH_COMPONENT.fullmatch(c) for c in components):
        raise InvalidReference(f"bad repository {path!r}")
    return ImageReference(registry=registry, repository=path, tag=tag, digest=digest)


def registry_matches(pattern: str, ref: ImageReference) -> bool:
    """`*` matches anything; `host[:port]` a whole registry; `host/path` that repository or
    any under it (`ghcr.io/acme` matches `ghcr.io/acme/train`, not `ghcr.io/acmecorp/x`)."""
    if pattern == ANY_REGISTRY:
        return True
    host, _, prefix = pattern.lower().partition("/")
    if host in _DOCKER_HUB_ALIASES:
        host = DOCKER_HUB
    if host != ref.registry:
        return False
    return not prefix or ref.repository == prefix or ref.repository.startswith(prefix + "/")


def valid_registry_pattern(pattern: str) -> bool:
    if pattern == ANY_REGISTRY:
        return True
    host, sep, prefix = pattern.partition("/")
    if not _HOST.fullmatch(host):
        return False
    return not sep or all(_PATH_COMPONENT.fullmatch(c) for c in prefix.split("/"))


# Signatures -----------------------------------------------------------------------------------


def simple_signing_payload(image: str | ImageReference,
                           optional: Mapping[str, Any] | None = None) -> bytes:
    """The bytes cosign signs for a digest-pinned image (compact JSON, its field order)."""
    ref = image if isinstance(image, ImageReference) else parse_reference(image)
    if ref.digest is None:
        raise InvalidReference("a signature covers a digest; the reference has none")
    doc = {
        "critical": {
            "identity": {"docker-reference": ref.signing_identity},
            "image": {"docker-manifest-digest": ref.digest},
            "type": COSIGN_SIGNATURE_TYPE,
        },
        "optional": None if optional is None else dict(sorted(optional.items())),
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey


@lru_cache(maxsize=256)
def load_public_key(pem: str) -> PublicKey:
    """A trusted key from PEM; only ECDSA P-256 and Ed25519 are accepted (ValueError else)."""
    key = serialization.load_pem_public_key(pem.encode())
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    raise ValueError("only ECDSA P-256 and Ed25519 public keys are supported")


def verify_signature(payload: bytes, signature: bytes, key: PublicKey) -> bool:
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, payload)
        else:
            key.verify(signature, payload, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        return False
    return True


def signed_by(ref: ImageReference, signature_b64: str | None,
              keys: Iterable[tuple[str, str]]) -> str | None:
    """The id of the first trusted key the signature verifies under, or None."""
    if not signature_b64 or not ref.is_digest_pinned:
        return None
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return None
    payload = simple_signing_payload(ref)
    for key_id, pem in keys:
        try:
            key = load_public_key(pem)
        except ValueError:
            continue  # a key that does not load verifies nothing
        if verify_signature(payload, signature, key):
            return key_id
    return None


# The policy -----------------------------------------------------------------------------------

DEFAULT_ISOLATION_BY_TRUST: tuple[tuple[str, str], ...] = (
    ("marketplace", "sandboxed"), ("trusted", "container"),
)


@dataclass(frozen=True)
class ImagePolicy:
    """Which images a pool admits and how isolated a workload must be where it runs.

    `approved_registries` entries are `*`, `host[:port]` or `host/repository-prefix`; a tenant
    listed in `tenant_registries` uses its own list instead of the pool's. Digest pinning is
    always required. `isolation_by_trust` names the weakest isolation class allowed on a node
    of each trust level; tenants in `untrusted_tenants` need `untrusted_tenant_isolation` or
    stronger anywhere. `max_image_size_bytes` None: no limit."""

    approved_registries: tuple[str, ...] = (ANY_REGISTRY,)
    tenant_registries: tuple[tuple[str, tuple[str, ...]], ...] = ()  # sorted (tenant, list)
    trusted_keys: tuple[tuple[str, str], ...] = ()  # sorted (key id, public key PEM)
    require_signature: bool = False
    max_image_size_bytes: int | None = None
    isolation_by_trust: tuple[tuple[str, str], ...] = DEFAULT_ISOLATION_BY_TRUST
    untrusted_tenants: tuple[str, ...] = ()
    untrusted_tenant_isolation: str = "sandboxed"

    def __post_init__(self) -> None:
        object.__setattr__(self, "approved_registries",
                           tuple(dict.fromkeys(str(r) for r in self.approved_registries)))
        object.__setattr__(self, "tenant_registries", tuple(sorted(
            (str(t), tuple(dict.fromkeys(str(r) for r in rs)))
            for t, rs in dict(self.tenant_registries).items()
        )))
        object.__setattr__(self, "trusted_keys", tuple(sorted(
            (str(k), str(v)) for k, v in dict(self.trusted_keys).items()
        )))
        object.__setattr__(self, "isolation_by_trust", tuple(sorted(
            (str(k), str(v)) for k, v in dict(self.isolation_by_trust).items()
        )))
        object.__setattr__(self, "untrusted_tenants",
                           tuple(sorted({str(t) for t in self.untrusted_tenants})))

    def problems(self) -> list[str]:
        """Every inconsistency, as reason strings; empty when the policy is valid."""
        found = []
        lists = [self.approved_registries] + [rs for _, rs in self.tenant_registries]
        for pattern in (p for rs in lists for p in rs):
            if not valid_registry_pattern(pattern):
                found.append(f"registry {pattern!r} is not *, host[:port] or host/repository")
        for key_id, pem in self.trusted_keys:
            try:
                load_public_key(pem)
            except ValueError as e:
                found.append(f"key {key_id!r}: {str(e).splitlines()[0] if str(e) else 'bad PEM'}")
        if self.require_signature and not self.trusted_keys:
            found.append("require_signature needs at least one trusted key")
        if self.max_image_size_bytes is not None and self.max_image_size_bytes <= 0:
            found.append("max_image_size_bytes must be positive")
        by_trust = dict(self.isolation_by_trust)
        for level in sorted(set(by_trust) - set(TRUST_LEVELS)):
            found.append(f"unknown trust level {level!r}")
        for level in TRUST_LEVELS:
            if level not in by_trust:
                found.append(f"isolation for trust level {level!r} is not set")
        for cls in sorted(set(by_trust.values()) | {self.untrusted_tenant_isolation}):
            if cls not in ISOLATION_ORDER:
                found.append(f"unknown isolation class {cls!r}")
        return found

    # Queries ----------------------------------------------------------------------------------

    def registries_for(self, tenant: str | None) -> tuple[str, ...]:
        own = dict(self.tenant_registries).get(tenant) if tenant is not None else None
        return own if own is not None else self.approved_registries

    def required_isolation(self, *, node_trust: str | None, tenant: str | None) -> str:
        """The weakest class allowed for `tenant` on a node of `node_trust` (None: not known
        yet, so only the tenant counts). An unknown trust level requires the strongest."""
        needed = ISOLATION_ORDER[0]
        if node_trust is not None:
            needed = dict(self.isolation_by_trust).get(node_trust, ISOLATION_ORDER[-1])
        if tenant is not None and tenant in self.untrusted_tenants:
            needed = _stronger(needed, self.untrusted_tenant_isolation)
        return needed

    def allowed_trust_levels(self, *, isolation: str, tenant: str | None) -> tuple[str, ...]:
        """Trust levels of nodes a workload of `isolation` for `tenant` may be placed on (the
        scheduler can pass these to NodeTable.place as `allowed_trust_levels`)."""
        return tuple(t for t in TRUST_LEVELS if _at_least(
            isolation, self.required_isolation(node_trust=t, tenant=tenant)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "approved_registries": list(self.approved_registries),
            "tenant_registries": {t: list(rs) for t, rs in self.tenant_registries},
            "trusted_keys": {k: pem for k, pem in self.trusted_keys},
            "require_signature": self.require_signature,
            "max_image_size_bytes": self.max_image_size_bytes,
            "isolation_by_trust": {k: v for k, v in self.isolation_by_trust},
            "untrusted_tenants": list(self.untrusted_tenants),
            "untrusted_tenant_isolation": self.untrusted_tenant_isolation,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ImagePolicy:
        size = d.get("max_image_size_bytes")
        return cls(
            approved_registries=tuple(d.get("approved_registries", (ANY_REGISTRY,))),
            tenant_registries=tuple(
                (t, tuple(rs)) for t, rs in dict(d.get("tenant_registries", {})).items()
            ),
            trusted_keys=tuple(dict(d.get("trusted_keys", {})).items()),
            require_signature=bool(d.get("require_signature", False)),
            max_image_size_bytes=None if size is None else int(size),
            isolation_by_trust=tuple(
                dict(d.get("isolation_by_trust", dict(DEFAULT_ISOLATION_BY_TRUST))).items()
            ),
            untrusted_tenants=tuple(d.get("untrusted_tenants", ())),
            untrusted_tenant_isolation=str(d.get("untrusted_tenant_isolation", "sandboxed")),
        )


def _rank(isolation: str) -> int:
    return ISOLATION_ORDER.index(isolation) if isolation in ISOLATION_ORDER else -1


def _at_least(isolation: str, required: str) -> bool:
    return _rank(isolation) >= 0 and _rank(isolation) >= _rank(required)


def _stronger(a: str, b: str) -> str:
    return a if _rank(a) >= _rank(b) else b


# Checks ---------------------------------------------------------------------------------------


def check_runtime(policy: ImagePolicy, *, isolation: str, node_trust: str | None = None,
                  tenant: str | None = None) -> list[str]:
    """`runtime_not_allowed` when `isolation` is weaker than the node's trust level (where
    known) or the tenant's standing requires; an unknown class is never allowed."""
    required = policy.required_isolation(node_trust=node_trust, tenant=tenant)
    return [] if _at_least(isolation, required) else [RUNTIME_NOT_ALLOWED]


def check_image(
    policy: ImagePolicy,
    image: str,
    signature: str | None = None,
    size_bytes: int | None = None,
    tenant: str | None = None,
    *,
    node_trust: str | None = None,
    isolation: str | None = None,
) -> list[str]:
    """Every reason `image` may not run under `policy`, in a stable order; empty: allowed.

    `size_bytes` None is not checked (the agent re-checks the pulled size); `isolation` None
    skips the runtime check, `node_trust` None checks only the tenant's requirement."""
    try:
        ref = parse_reference(image)
    except InvalidReference:
        reasons = [IMAGE_REFERENCE_INVALID]
    else:
        reasons = []
        if not any(registry_matches(p, ref) for p in policy.registries_for(tenant)):
            reasons.append(IMAGE_REGISTRY_NOT_APPROVED)
        if not ref.is_digest_pinned:
            reasons.append(IMAGE_NOT_DIGEST_PINNED)
        if policy.require_signature and signed_by(ref, signature, policy.trusted_keys) is None:
            reasons.append(IMAGE_SIGNATURE_INVALID)
    if (policy.max_image_size_bytes is not None and size_bytes is not None
            and size_bytes > policy.max_image_size_bytes):
        reasons.append(IMAGE_TOO_LARGE)
    if isolation is not None:
        reasons += check_runtime(policy, isolation=isolation, node_trust=node_trust,
                                 tenant=tenant)
    return reasons


def verify_for_start(
    policy: Mapping[str, Any],
    image: str | None,
    signature: str | None,
    size_bytes: int | None,
    node_trust: str,
    isolation: str,
    tenant: str | None = None,
) -> list[str]:
    """The agent's check before start, on the policy as `ImagePolicy.to_dict()` shipped it;
    a policy that does not load refuses everything (`image_policy_invalid`)."""
    try:
        loaded = ImagePolicy.from_dict(policy)
    except (AttributeError, KeyError, TypeError, ValueError):
        return [IMAGE_POLICY_INVALID]
    if loaded.problems():
        return [IMAGE_POLICY_INVALID]
    if not image:
        return check_runtime(loaded, isolation=isolation, node_trust=node_trust, tenant=tenant)
    return check_image(loaded, image, signature, size_bytes, tenant,
                       node_trust=node_trust, isolation=isolation)


__all__ = [
    "ANY_REGISTRY",
    "REASON_CODES",
    "ImagePolicy",
    "ImageReference",
    "InvalidReference",
    "check_image",
    "check_runtime",
    "parse_reference",
    "signed_by",
    "simple_signing_payload",
    "verify_for_start",
]
