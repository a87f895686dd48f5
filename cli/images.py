"""`pool image keygen|sign`: image signing keys and signatures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli.output import (
    EXIT_OK,
    Subparsers,
    UsageError,
)


def cmd_image_keygen(args: argparse.Namespace) -> int:
    """`pool image keygen PREFIX`: PREFIX.key (private, 0600) and PREFIX.pub (public)."""
    import os

    from cli.image_signing import generate_key_pair

    private_pem, public_pem = generate_key_pair(args.kind)
    private_path, public_path = Path(f"{args.prefix}.key"), Path(f"{args.prefix}.pub")
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(private_pem)
    public_path.write_text(public_pem)
    result = {"private_key": str(private_path), "public_key": str(public_path), "kind": args.kind}
    print(json.dumps({"ok": True, "result": result}) if args.json
          else f"{private_path}  (private)\n{public_path}  (public: pool admin pool images "
               f"--key-file {public_path})")
    return EXIT_OK


def cmd_image_sign(args: argparse.Namespace) -> int:
    """`pool image sign IMAGE --key K.key`: the base64 simple-signing signature."""
    from cli.image_signing import sign_image
    from domain.policy.images import InvalidReference

    try:
        signature = sign_image(Path(args.key).read_bytes(), args.image)
    except OSError as e:
        raise UsageError(f"cannot read key file {args.key}: {e.strerror}") from None
    except InvalidReference as e:
        raise UsageError(f"{args.image}: {e}") from None
    print(json.dumps({"ok": True, "result": {"image": args.image, "signature": signature}})
          if args.json else signature)
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `image`."""
    img = sub.add_parser("image", help="image signing keys and signatures").add_subparsers(
        dest="verb", metavar="VERB", required=True)
    ik = img.add_parser("keygen", help="a new signing key pair: PREFIX.key and PREFIX.pub")
    ik.add_argument("prefix")
    ik.add_argument("--kind", choices=["ecdsa-p256", "ed25519"], default="ecdsa-p256")
    ik.add_argument("--json", action="store_true")
    ik.set_defaults(func=cmd_image_keygen)
    isg = img.add_parser("sign", help="sign a digest-pinned image (cosign simple signing)")
    isg.add_argument("image")
    isg.add_argument("--key", required=True, help="private key PEM (`pool image keygen`)")
    isg.add_argument("--json", action="store_true")
    isg.set_defaults(func=cmd_image_sign)
