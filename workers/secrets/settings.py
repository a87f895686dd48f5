"""The operator's secret settings: the key ring that seals tenants' secrets (its first key the
one new values are sealed under) and how many secrets a tenant may keep."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from workers.sealing import KeyRing

ENV_KEYS = "POOL_SECRET_KEYS"
ENV_MAX_PER_TENANT = "POOL_SECRET_MAX_PER_TENANT"
PURPOSE = "job secrets"


@dataclass(frozen=True)
class SecretSettings:
    """`ring` None: secrets are off (nothing can seal one); a job naming one is refused."""

    ring: KeyRing | None = None
    max_per_tenant: int = 100

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SecretSettings:
        text = env.get(ENV_KEYS, "")
        return cls(ring=KeyRing.parse(text, purpose=PURPOSE) if text else None,
                   max_per_tenant=int(env.get(ENV_MAX_PER_TENANT, "") or 100))

    @classmethod
    def with_keys(cls, text: str, **kw: int) -> SecretSettings:
        """Settings with the ring `id=text[,id=text…]` (tests and `pool up`)."""
        return cls(ring=KeyRing.parse(text, purpose=PURPOSE), **kw)
