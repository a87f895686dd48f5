"""`pool schemas export`: the wire types as JSON Schema and AsyncAPI files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.output import (
    EXIT_OK,
    Subparsers,
)


def cmd_schemas_export(args: argparse.Namespace) -> int:
    from schemas.export import export
    from workers.routes import asyncapi_channels

    out = Path(args.dir)
    paths = export(asyncapi_channels(), out)
    if args.json:
        print(json.dumps({"ok": True, "files": [str(p) for p in paths]}))
    else:
        for p in paths:
            print(p)
        print(f"{len(paths)} schema files written to {out}")
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `schemas`."""
    sch = sub.add_parser("schemas", help="wire schemas").add_subparsers(dest="sub", metavar="VERB")
    sch.required = True
    exp = sch.add_parser("export", help="write JSON Schema and AsyncAPI files")
    exp.add_argument("--dir", default=str(Path(__file__).resolve().parent.parent / "schemas" / "json"))
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(func=cmd_schemas_export)
