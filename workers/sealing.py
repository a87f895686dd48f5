"""Sealing under the plane's keys: AES-256-GCM, each ciphertext bound to what it belongs to
(its context), and a key ring whose keys are named by ids stored with each ciphertext."""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 12
_KEY_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


class Unreadable(Exception):
    """A sealed value does not open under the key it names (another key, or tampered)."""

    code = "sealed_unreadable"


class BadKeyRing(ValueError):
    """The operator's key setting is not `id=text[,id=text…]` with distinct short ids."""

    code = "bad_key_ring"


def stretch(text: str, purpose: str) -> bytes:
    """A 32-byte key from the operator's text (a long random one is the operator's to
    choose), distinct per `purpose` so one setting never keys two uses alike."""
    return hashlib.sha256(f"computepool {purpose}\0".encode() + text.encode()).digest()


def seal_bytes(key: bytes, plaintext: bytes, *, context: str) -> bytes:
    """A fresh nonce and the AES-256-GCM ciphertext of `plaintext`, authenticated with
    `context` as associated data: a sealed value copied elsewhere does not open."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, context.encode())


def open_bytes(key: bytes, sealed: bytes, *, context: str) -> bytes:
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], context.encode())
    except (InvalidTag, ValueError) as e:
        raise Unreadable("a sealed value does not open under its key") from e


@dataclass(frozen=True)
class KeyRing:
    """The plane's keys by id; new values are sealed under `active`, and any key still in the
    ring opens what it sealed (rotation: add a new key first, re-seal, then drop the old)."""

    keys: Mapping[str, bytes]
    active: str

    @classmethod
    def parse(cls, text: str, *, purpose: str) -> KeyRing:
        """`id=text[,id=text…]`, the first the active key (POOL_SECRET_KEYS)."""
        keys: dict[str, bytes] = {}
        for part in (p.strip() for p in text.split(",")):
            key_id, sep, secret = part.partition("=")
            if not sep or not _KEY_ID.match(key_id) or not secret or key_id in keys:
                raise BadKeyRing("a key ring is `id=text[,id=text…]`: ids of 1-32 of a-z 0-9 _ -,"
                                 " each once, each with its text")
            keys[key_id] = stretch(secret, purpose)
        if not keys:
            raise BadKeyRing("a key ring needs at least one key")
        return cls(keys=keys, active=next(iter(keys)))

    def seal(self, plaintext: bytes, *, context: str) -> tuple[str, str]:
        """(the active key's id, the base64 sealed value)."""
        sealed = seal_bytes(self.keys[self.active], plaintext, context=context)
        return self.active, base64.b64encode(sealed).decode()

    def open(self, key_id: str, sealed: str, *, context: str) -> bytes:
        key = self.keys.get(key_id)
        if key is None:
            raise Unreadable(f"sealed under key {key_id!r}, which this plane's ring lacks")
        try:
            raw = base64.b64decode(sealed, validate=True)
        except ValueError as e:
            raise Unreadable("a sealed value is not base64") from e
        return open_bytes(key, raw, context=context)
