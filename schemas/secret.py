"""Version 1 of the secret commands' wire types: a tenant sets, lists and deletes its secrets
(`pool.cmd.<tenant>.secret.<verb>`), and a node fetches a lease's (`pool.node.<node>.lease.<id>
.secrets`, answered into that node's own inbox)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from schemas.v1 import Count, SchemaVersion, SecretName

MAX_SECRET_BYTES = 64 * 1024  # a token, a key, a small config file; not a data set


class SecretSet(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Store a new version of a secret (sealed at rest; never in the log). The reply names its
    version, never its value."""

    schema_version: SchemaVersion = 1
    name: SecretName
    value: Annotated[bytes, Meta(max_length=MAX_SECRET_BYTES)]


class SecretList(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The tenant's secrets: names, versions, sizes and times, never values."""

    schema_version: SchemaVersion = 1


class SecretDelete(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Delete a secret and every kept version of it; a job that needs it later fails."""

    schema_version: SchemaVersion = 1
    name: SecretName


class SecretFetch(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A node asks for the values of the secrets its running lease's job names, for the
    placement (`epoch`) it holds."""

    schema_version: SchemaVersion = 1
    epoch: Count


class SecretReseal(Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The operator re-seals every tenant's newest secret versions under the active key."""

    schema_version: SchemaVersion = 1


PUBLIC_STRUCTS: tuple[type[Struct], ...] = (SecretSet, SecretList, SecretDelete, SecretFetch,
                                            SecretReseal)
