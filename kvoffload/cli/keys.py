"""``kvoffload keys``: generate CURVE key pairs for the daemon and its clients.

Writes ``NAME.key`` (the public certificate, safe to copy) and ``NAME.key_secret`` (the secret,
mode 0600) in ``--out`` (created 0700), in ``zmq.auth`` certificate format. ``--allow DIR``
also copies the public certificate into a daemon's allow-list directory.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("keys", help="generate a CURVE key pair (NAME.key, NAME.key_secret)")
    k.add_argument("--out", required=True, help="directory for the key files (created 0700)")
    k.add_argument("--name", default="server",
                   help="file name stem: 'server' for the daemon, one per client (default server)")
    k.add_argument("--allow", metavar="DIR",
                   help="also copy the public certificate into this allow-list directory")
    k.add_argument("--force", action="store_true", help="replace an existing pair")
    k.set_defaults(handler=_keys)


def _keys(args: argparse.Namespace) -> int:
    from kvoffload.daemon.control.security import generate_keypair, load_public_key

    try:
        public, secret = generate_keypair(args.out, args.name, force=args.force)
        if args.allow:
            allow = Path(args.allow)
            allow.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.copyfile(public, allow / public.name)
    except (OSError, ValueError) as exc:
        print(f"kvoffload keys: {exc}", file=sys.stderr)
        return 1
    print(f"public key  {load_public_key(public).decode()}")
    print(f"public cert {public}")
    print(f"secret cert {secret} (mode 0600; keep it on this host)")
    return 0
