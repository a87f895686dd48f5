"""Making image signatures: new key pairs and cosign simple-signing signatures, for
`pool image keygen|sign` (the domain only verifies them: domain/policy/images.py)."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from domain.policy.images import simple_signing_payload


def sign_image(private_key_pem: str | bytes, image: str,
               optional: Mapping[str, Any] | None = None) -> str:
    """Sign an image's simple-signing payload; the base64 signature (for tests and the CLI)."""
    data = private_key_pem.encode() if isinstance(private_key_pem, str) else private_key_pem
    key = serialization.load_pem_private_key(data, password=None)
    payload = simple_signing_payload(image, optional)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        raw = key.sign(payload)
    elif isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1):
        raw = key.sign(payload, ec.ECDSA(hashes.SHA256()))
    else:
        raise TypeError("only ECDSA P-256 and Ed25519 private keys are supported")
    return base64.b64encode(raw).decode()


def generate_key_pair(kind: str = "ecdsa-p256") -> tuple[str, str]:
    """A new (private PEM, public PEM) pair, `ecdsa-p256` or `ed25519` (tests and the CLI)."""
    private: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey
    if kind == "ecdsa-p256":
        private = ec.generate_private_key(ec.SECP256R1())
    elif kind == "ed25519":
        private = ed25519.Ed25519PrivateKey.generate()
    else:
        raise ValueError(f"unknown key kind {kind!r}; use ecdsa-p256 or ed25519")
    private_pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    public_pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo,
    ).decode()
    return private_pem, public_pem
