"""``mlx-fleet certs``: the certificates and keys a closed fleet needs (docs/security.md, "A
closed install"), made with ``cryptography`` (:mod:`mlx_fleet.certs`).

  certs ca --out DIR                     a CA for the fleet: DIR/ca.crt, DIR/ca.key
  certs node NAME --host H... --out DIR  a Mac's certificate, client and server, CN
                                         mlx-fleet-agent-NAME (its etcd user), SANs NAME and
                                         every --host: DIR/NAME.crt, DIR/NAME.key
  certs server NAME --host H... --out DIR  a server's (etcd's, the router's), CN NAME
  certs client USER --out DIR            a client certificate, CN USER (mlx-fleet-operator,
                                         mlx-fleet-router, root): DIR/USER.crt, DIR/USER.key
  certs keys --out FILE                  an API key file with random keys (--count, --tenant)
  certs jwt-keys --out DIR               a key pair for etcd's --auth-token jwt: DIR/jwt.key,
                                         DIR/jwt.pub (--alg ES256 or RS256)

``node``, ``server`` and ``client`` sign with the CA of ``--ca-cert``/``--ca-key`` (one made by
``certs ca``, or one the organisation gives: a PEM certificate with ``ca=true`` and its
unencrypted PEM key). Every file is written with mode 0600, and none is replaced unless
``--force``: exit status 2 with one line naming the file otherwise. A printed line per file
written; key material is never printed.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from mlx_fleet import certs
from mlx_fleet.etcd_security import agent_user
from mlx_fleet.routing.api_keys import parse_key_entries

#: A node or user name that is also a file name and a certificate name.
_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?")

__all__ = ["add_arguments", "run"]


def _positive_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of days, got {text!r}") from None
    if not 0 < days <= 100 * 365:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 36500, got {text!r}")
    return days


def _name(text: str) -> str:
    """A node or user name: letters, digits, '-', '_' and '.' inside, at most 253."""
    if not _NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r}: letters, digits, '-', '_' and '.' (inside) only, at most 253")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="certs_command", required=True, metavar="ACTION")

    def out_dir(s: argparse.ArgumentParser) -> None:
        s.add_argument("--out", type=Path, default=Path("."), metavar="DIR",
                       help="directory to write to (default: the current one)")
        s.add_argument("--force", action="store_true", help="replace files that exist")

    def signed(s: argparse.ArgumentParser) -> None:
        s.add_argument("--ca-cert", type=Path, default=Path("ca.crt"), metavar="PATH",
                       help="the CA's PEM certificate (default: %(default)s)")
        s.add_argument("--ca-key", type=Path, default=Path("ca.key"), metavar="PATH",
                       help="the CA's unencrypted PEM key (default: %(default)s)")
        s.add_argument("--days", type=_positive_days, default=certs.DEFAULT_LEAF_DAYS,
                       help="validity in days (default: %(default)s)")
        out_dir(s)

    s = sub.add_parser("ca", help="make a CA for the fleet (ca.crt, ca.key)")
    s.add_argument("--name", default="mlx-fleet CA", help="its common name (default: %(default)s)")
    s.add_argument("--days", type=_positive_days, default=certs.DEFAULT_CA_DAYS,
                   help="validity in days (default: %(default)s)")
    out_dir(s)
    s.set_defaults(func=run)

    s = sub.add_parser("node", help="a Mac's certificate: etcd client (CN mlx-fleet-agent-NAME) "
                                    "and HTTPS server (SANs NAME and each --host)")
    s.add_argument("name", type=_name, metavar="NAME", help="the Mac's node name "
                                                           "(its agent's --node-name)")
    s.add_argument("--host", action="append", default=[], metavar="HOST",
                   help="a host name or IP address clients and other Macs use to reach it "
                        "(repeatable; e.g. studio-1.lan, 192.0.2.10)")
    signed(s)
    s.set_defaults(func=run)

    s = sub.add_parser("server", help="a server certificate (etcd's, the router's): CN NAME, "
                                      "SANs each --host")
    s.add_argument("name", type=_name, metavar="NAME", help="its common name and file name")
    s.add_argument("--host", action="append", default=[], metavar="HOST", required=True,
                   help="a host name or IP address clients dial (repeatable)")
    signed(s)
    s.set_defaults(func=run)

    s = sub.add_parser("client", help="a client certificate: CN USER (its etcd user with "
                                      "--client-cert-auth)")
    s.add_argument("name", type=_name, metavar="USER",
                   help="e.g. mlx-fleet-operator, mlx-fleet-router, root")
    signed(s)
    s.set_defaults(func=run)

    s = sub.add_parser("keys", help="an API key file with random keys (mode 0600)")
    s.add_argument("--out", type=Path, required=True, metavar="FILE", help="the key file")
    s.add_argument("--count", type=int, default=1, choices=range(1, 101), metavar="N",
                   help="keys to write, one a line (default: %(default)s)")
    s.add_argument("--tenant", default=None, metavar="NAME",
                   help="add tenant=NAME to each line (the fleet router's tenants)")
    s.add_argument("--force", action="store_true", help="replace the file if it exists")
    s.set_defaults(func=run)

    s = sub.add_parser("jwt-keys", help="a key pair for etcd's --auth-token jwt "
                                        "(jwt.key, jwt.pub)")
    s.add_argument("--alg", choices=["ES256", "RS256"], default="ES256",
                   help="etcd's sign-method (default: %(default)s)")
    out_dir(s)
    s.set_defaults(func=run)


def _files(args: argparse.Namespace) -> dict[Path, bytes]:
    """The files ``args`` asks for (path → bytes). Raises ``ValueError`` (one line)."""
    cmd = args.certs_command
    if cmd == "ca":
        key, cert = certs.make_ca(args.name, days=args.days)
        return {args.out / "ca.crt": certs.cert_pem(cert), args.out / "ca.key": certs.key_pem(key)}
    if cmd == "keys":
        suffix = f" tenant={args.tenant}" if args.tenant else ""
        text = "".join(f"{certs.api_key()}{suffix}\n" for _ in range(args.count))
        try:
            parse_key_entries(text)  # the agents' and the router's own check of the lines
        except ValueError:
            raise ValueError(f"--tenant {args.tenant!r}: a tenant name is a DNS label (1 to 63 "
                             f"characters a-z, 0-9 and '-')") from None
        return {args.out: text.encode()}
    if cmd == "jwt-keys":
        private, public = certs.jwt_keys(args.alg)
        return {args.out / "jwt.key": private, args.out / "jwt.pub": public}
    ca_key, ca_cert = certs.load_ca(args.ca_cert, args.ca_key)
    if cmd == "node":
        key, cert = certs.make_leaf(ca_key, ca_cert, agent_user(args.name),
                                    hosts=[args.name, *args.host], server=True, client=True,
                                    days=args.days)
    else:
        key, cert = certs.make_leaf(ca_key, ca_cert, args.name,
                                    hosts=getattr(args, "host", ()),
                                    server=cmd == "server", client=True, days=args.days)
    return {args.out / f"{args.name}.crt": certs.cert_pem(cert),
            args.out / f"{args.name}.key": certs.key_pem(key)}


def run(args: argparse.Namespace) -> int:
    try:
        files = _files(args)
        certs.write_private(files, force=args.force)
    except (ValueError, FileExistsError, OSError) as e:
        reason = getattr(e, "strerror", None) if isinstance(e, OSError) and not isinstance(
            e, FileExistsError) else None
        print(f"mlx-fleet certs {args.certs_command}: {reason or e}"
              + (f" ({getattr(e, 'filename', '')})" if reason else ""), file=sys.stderr)
        return 2
    for path in files:
        print(f"wrote {path} (mode 0600)")
    return 0
