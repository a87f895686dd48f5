"""Fault scenario 8: hostile bodies on every command subject; each gets a typed answer."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

from bus.errors import BusError
from chaos.harness import (
    Outcome,
    Workspace,
    error_code,
    known_codes,
    lease_body,
    must,
    node_body,
    setup_pool,
)

# -- 8. bad input -----------------------------------------------------------------------------------


def fuzz_subjects(lease_id: str) -> dict[str, dict[str, Any]]:
    """Every subject the command service (and the scheduler's `why`) answers, wildcards filled
    with a real tenant, lease and node, each with a valid body to mutate."""
    from workers.commands import ADMIN_SUBJECTS, COMMAND_SUBJECTS
    from workers.routes import NODE_VERBS

    job = {"image": "reg.example/job@sha256:" + "c" * 64, "command": ["true"]}
    verbs: dict[str, dict[str, Any]] = {
        "request": lease_body("fuzz-base"), "commit": {"job": job},
        "heartbeat": {"epoch": 1, "last_checkpoint_at": 1.7e9}, "renew": {"extend_seconds": 60},
        "release": {"exit_code": 0}, "cancel": {"reason": "fuzz"}, "get": {}, "why": {},
        "stopped": {"epoch": 1}, "started": {"epoch": 1, "job_number": 1},
        "exited": {"epoch": 1, "exit_code": 0}, "failed": {"epoch": 1, "reason": "oom"},
        "register": node_body("n1"), "replay": {"since": 0, "limit": 10},
        "heartbeat-node": {"node_id": "n1", "seq": 1,
                           "leases": [{"lease_id": lease_id, "epoch": 1}]},
        "offline": {"reason": "fuzz"},
        # a documentation-range address: refused as reserved, no name to resolve
        "add": {"url": "https://203.0.113.5/hook", "events": ["ended"]}, "list": {},
        "delete": {"endpoint_id": "wh-fuzz"}, "test": {"endpoint_id": "wh-fuzz"},
        "deliveries": {"limit": 10},
        "session": {"session_id": "0123456789abcdef0123456789abcdef", "kind": "exec",
                    "command": ["true"]},
        "secrets": {"epoch": 1},
        # a verb two groups share is keyed by its group too
        "secret.set": {"name": "fuzz", "value": "ZnV6eg=="}, "secret.list": {},
        "secret.delete": {"name": "fuzz"},
    }
    out: dict[str, dict[str, Any]] = {}
    for pattern in [*COMMAND_SUBJECTS, "pool.cmd.*.lease.*.why"]:
        parts = pattern.split(".")
        fill = iter(("alpha", lease_id) if parts[1] == "cmd" else ("n1", lease_id))
        subject = ".".join(next(fill) if p == "*" else p for p in parts)
        verb = parts[-1]
        if parts[1] == "node" and verb == "heartbeat":
            verb = "heartbeat-node"
        if f"{parts[-2]}.{verb}" in verbs:
            verb = f"{parts[-2]}.{verb}"
        if verb not in verbs:
            raise KeyError(f"{pattern}: the fuzz has no valid body for a new route; add one")
        out[subject] = verbs[verb]
    assert ADMIN_SUBJECTS == ["pool.admin.>"]
    admin: dict[str, dict[str, Any]] = {
        "pool.admin.pool.set": {"pool_id": "p1", "priority_classes": {"standard": 10},
                                "node_timeout_seconds": 86_400},
        "pool.admin.pool.create": {"pool_id": "p2"},
        "pool.admin.pool.show": {"pool_id": "p1"},
        "pool.admin.pool.prices": {"pool_id": "p1", "cpu_core_second": 1},
        "pool.admin.pool.images": {"pool_id": "p1", "approved_registries": ["*"]},
        "pool.admin.tenant.set": {"tenant": "alpha", "pool_id": "p1", "weight": 1.0},
        "pool.admin.node.register": node_body("n1"),
        "pool.admin.credits.grant": {"tenant": "alpha", "amount_microcredits": 1,
                                     "transfer_id": "fuzz"},
        "pool.admin.no.such.command": {},
    }
    for verb in NODE_VERBS:
        admin[f"pool.admin.node.n1.{verb}"] = {"reason": "fuzz"}
    out.update(admin)
    return out


def _bodies(st: Any, base: dict[str, Any]) -> Any:
    """Hypothesis strategy of hostile bodies derived from one valid `base` body."""
    scalars = st.one_of(
        st.integers(min_value=-(2**80), max_value=2**80),
        st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, 10**400, 1e308, -1e308, 0, -1]),
        st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none(),
        st.text(max_size=40), st.sampled_from(["", " ", "\u0000", "\u2028", "../..", "*", ">",
                                               "a.b", "x" * 300, "\U0001f600"]),
    )
    def nested(kids: Any) -> Any:
        # named, not a lambda: Hypothesis describes a lambda by parsing its source, which
        # CPython 3.11.7 can fail ("AST constructor recursion depth mismatch")
        return st.one_of(st.lists(kids, max_size=4),
                         st.dictionaries(st.text(max_size=12), kids, max_size=4))

    values = st.recursive(scalars, nested, max_leaves=12)

    def paths(d: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        out = [prefix] if prefix else []
        if isinstance(d, dict):
            for k, v in d.items():
                out += paths(v, (*prefix, k))
        elif isinstance(d, list):
            for i, v in enumerate(d):
                out += paths(v, (*prefix, i))
        return out

    def put(d: Any, path: tuple[Any, ...], value: Any) -> Any:
        d = json.loads(json.dumps(d))
        cur = d
        for p in path[:-1]:
            cur = cur[p]
        cur[path[-1]] = value
        return d

    def dumps(v: Any) -> bytes:
        return json.dumps(v, allow_nan=True).encode()

    all_paths = paths(base) or [("extra",)]

    def at(d: Any, path: tuple[Any, ...]) -> Any:
        for p in path:
            d = d[p]
        return d

    # numbers where numbers go: the right type, at edges the schema may or may not allow
    numeric = [p for p in paths(base) if isinstance(at(base, p), (int, float))
               and not isinstance(at(base, p), bool)] or all_paths
    edges = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**53, 2**63 - 1, 10**15,
                                       10**15 + 1, 86_400, 31_536_000, 0.5, 1e-9, 1e15]),
                      st.integers(min_value=0, max_value=2**64))
    # named functions rather than lambdas throughout: Hypothesis describes a lambda by parsing
    # its source, which CPython 3.11.7 can fail ("AST constructor recursion depth mismatch")
    def put_pair(pv: tuple[Any, Any]) -> bytes:
        return dumps(put(base, pv[0], pv[1]))

    def with_extra(extra: dict[str, Any]) -> bytes:
        return dumps({**base, **extra})

    def nest_deep(d: tuple[int, str]) -> bytes:
        return (d[1] * d[0]).encode() + (b"]" if d[1] == "[" else b"}") * d[0]

    def splice(ib: tuple[int, bytes]) -> bytes:
        return dumps(base)[:ib[0]] + ib[1] + dumps(base)[ib[0]:]

    edge_numbers = st.tuples(st.sampled_from(numeric), edges).map(put_pair)
    mutated = st.tuples(st.sampled_from(all_paths), values).map(put_pair)
    unknown = st.dictionaries(st.text(min_size=1, max_size=20), values, min_size=1,
                              max_size=3).map(with_extra)
    wrong_top = values.map(dumps)
    deep = st.tuples(st.integers(10, 160_000), st.sampled_from(["[", '{"a":'])).map(nest_deep)
    bad_utf8 = st.tuples(st.integers(0, max(0, len(dumps(base)) - 1)),
                         st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80",
                                          b"\xf8\x88\x80\x80\x80"])).map(splice)
    # up to the server's max_payload, and past it (the client must refuse that, typed)
    def padded(n: int) -> bytes:
        return dumps({**base, "padding": "x" * n})

    oversized = st.integers(60_000, 1_100_000).map(padded)
    raw = st.binary(max_size=200)
    weird_json = st.sampled_from([b"", b"null", b"NaN", b"Infinity", b"-Infinity", b"1e999",
                                  b'{"pool_id": NaN}', b"{", b"}", b'{"a":1,"a":2}',
                                  b'{"schema_version": 99}', b'{"schema_version": 0}',
                                  b'{"schema_version": "1"}', b"\xef\xbb\xbf{}"])
    return st.one_of(mutated, edge_numbers, unknown, wrong_top, deep, bad_utf8, oversized,
                     raw, weird_json)


def scenario_bad_input(ws: Workspace, size: dict[str, Any], o: Outcome) -> None:
    """Hypothesis-generated hostile bodies on every command subject, against a `pool serve`
    process: each must get a typed refusal (or a typed success), and the service must live."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from bus.errors import PayloadTooLarge
    from bus.replies import admin_inbox, expected_inbox

    url = ws.nats().url
    serve = ws.serve(url, name="serve")
    admin = ws.client(url)
    setup_pool(admin, ["alpha"], nodes=1)
    alpha = ws.client(url, "alpha")
    lease_id = must(alpha.request_lease(lease_body("fuzz-lease")))["lease"]["lease_id"]
    subjects = fuzz_subjects(lease_id)
    known = known_codes()
    # each subject is asked from the inbox the service answers it on (a tenant's, a node's or
    # the operator's): a reply subject anywhere else is refused before any body is read
    clients: dict[str, Any] = {}

    def client_for(subject: str) -> Any:
        prefix = expected_inbox(subject) or admin_inbox("operator")
        if prefix not in clients:
            clients[prefix] = ws.client(url, timeout=10, inbox_prefix=prefix.encode())
        return clients[prefix]

    inputs = [0]
    crashes: Counter[str] = Counter()
    untyped: Counter[str] = Counter()
    codes: Counter[str] = Counter()

    strategies = {subject: _bodies(st, base) for subject, base in subjects.items()}

    @settings(max_examples=int(size["inputs"]), deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(st.data())
    def probe(data: Any) -> None:
        subject = data.draw(st.sampled_from(sorted(subjects)))
        body = data.draw(strategies[subject])
        inputs[0] += 1
        try:
            reply = client_for(subject).raw(subject, body)
        except PayloadTooLarge:
            codes["payload_too_large (client)"] += 1
            return
        except BusError as e:
            crashes[f"{error_code(e)} on {subject}"] += 1
            return
        except ValueError:
            untyped[f"non-JSON reply on {subject}"] += 1
            return
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            untyped[f"not an envelope on {subject}"] += 1
            return
        if reply["ok"]:
            codes["ok"] += 1
            return
        code = (reply.get("error") or {}).get("code")
        codes[str(code)] += 1
        if code in ("internal_error", "bus_unavailable"):  # the service and the bus are up
            crashes[f"{code} on {subject}"] += 1
        elif code not in known:
            untyped[f"{code!r} on {subject}"] += 1

    with warnings.catch_warnings():
        # Hypothesis questions a recursive strategy's use of its argument now and then
        # (HypothesisDeprecationWarning); it is used, and the inputs are what they are
        warnings.simplefilter("ignore")
        probe()
    alive = serve.alive()
    after = alpha.request_lease(lease_body("after-fuzz")) if alive else {}
    answers = bool(after.get("ok")) and bool(
        alpha.lease(after["lease"]["lease_id"], "get").get("ok"))
    tracebacks = serve.output().count("Traceback")
    o.figures.update(inputs=inputs[0], subjects=len(subjects))
    o.zero("crashes", sum(crashes.values()) + (not alive) + tracebacks,
           ", ".join(f"{k}×{v}" for k, v in crashes.most_common(3))
           + ("" if alive else " service died") + (f" {tracebacks} tracebacks logged"
                                                   if tracebacks else ""))
    o.zero("untyped_errors", sum(untyped.values()),
           ", ".join(f"{k}×{v}" for k, v in untyped.most_common(3)))
    o.figures["answers_after"] = "yes" if answers else "no"
    o.expect(answers, "the service did not answer a valid request afterwards")
    o.figures["codes"] = len(codes)
    o.detail = dict(codes)
