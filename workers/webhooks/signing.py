"""Standard Webhooks signatures (webhook-id, webhook-timestamp, webhook-signature: `v1,` and the
base64 HMAC-SHA256 of "id.timestamp.body" under the endpoint's `whsec_` secret), and the
sealing of those secrets under the plane's key so none is ever stored in clear."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

from workers.sealing import Unreadable, open_bytes, seal_bytes, stretch

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
_SEALED = "v1:"


class SealedSecretUnreadable(Exception):
    """A sealed secret does not open under this plane's key (another key, or tampered)."""

    code = "webhook_secret_unreadable"


def new_secret() -> str:
    """A fresh endpoint secret, as Standard Webhooks writes them: `whsec_` + base64."""
    return SECRET_PREFIX + base64.b64encode(os.urandom(SECRET_BYTES)).decode()


def _key_bytes(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX))


def signature(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The webhook-signature header's value: `v1,<base64 HMAC-SHA256>`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    mac = hmac.new(_key_bytes(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(timestamp)),
            "webhook-signature": signature(secret, msg_id, int(timestamp), body),
            "content-type": "application/json"}


def plane_key(text: str) -> bytes:
    """The sealing key from the operator's setting (POOL_WEBHOOK_KEY): any text, stretched
    to 32 bytes (a long random one is the operator's to choose)."""
    return stretch(text, "webhook secrets")


def seal(key: bytes, secret: str, *, context: str) -> str:
    """`secret` encrypted (AES-256-GCM) under `key`, bound to `context` (tenant and endpoint:
    a sealed secret copied to another endpoint does not open)."""
    sealed = seal_bytes(key, secret.encode(), context=context)
    return _SEALED + base64.b64encode(sealed).decode()


def unseal(key: bytes, sealed: str, *, context: str) -> str:
    try:
        raw = base64.b64decode(sealed.removeprefix(_SEALED))
        return open_bytes(key, raw, context=context).decode()
    except (Unreadable, ValueError) as e:
        raise SealedSecretUnreadable("a webhook secret does not open under this plane's key "
                                     "(POOL_WEBHOOK_KEY changed?)") from e
