"""Name-based ids made without the JSON encoder must be exactly the UUIDs they always were."""

from __future__ import annotations

import json
import random
import uuid

import domain.lease as lease_module
from domain import Lease
from domain.ids import pair_uuid

NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "urn:test")
AWKWARD = ['', 'a', '"', '\\', '\x00', '\x1f', '\x7f', ' ', 'é', '\u2028', '😀', '</', '["x", "y"]',
           'tenant-7', 'req#3', "it's", '\t\n']


def test_a_pair_id_is_uuid5_of_the_json_pair() -> None:
    rng = random.Random(7)
    alphabet = [chr(c) for c in range(0x80)] + ['é', '\u2028', '😀']
    cases = [(a, b) for a in AWKWARD for b in AWKWARD]
    cases += [(''.join(rng.choices(alphabet, k=rng.randint(0, 8))),
               ''.join(rng.choices(alphabet, k=rng.randint(0, 8)))) for _ in range(5000)]
    for first, second in cases:
        want = uuid.uuid5(NAMESPACE, json.dumps([first, second]))
        got = pair_uuid(NAMESPACE, first, second)
        assert got == want and str(got) == str(want) and hash(got) == hash(want)
        assert (got.version, got.variant, got.is_safe) == (5, want.variant, want.is_safe)


def test_the_lease_id_is_what_it_always_was() -> None:
    for tenant in AWKWARD[1:]:
        for key in AWKWARD:
            assert Lease.create_id(tenant, key) == uuid.uuid5(
                lease_module._NAMESPACE, json.dumps([tenant, key]))
