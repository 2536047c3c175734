"""``mlx-fleet etcd bootstrap-auth``: create mlx-fleet's least-privilege etcd users and roles
and turn etcd's authentication on (docs/security.md).

It applies :func:`mlx_fleet.etcd_security.plan_auth` for the operator, the fleet router (read
only) and one agent per ``--node``: users ``root``, ``mlx-fleet-operator``, ``mlx-fleet-router``
and ``mlx-fleet-agent-<node>``, each holding the role of the same name. Users without ``--password-file USER=PATH`` get no password: they
log in with a client certificate whose Common Name is the user name (etcd started with
``--client-cert-auth``). Safe to run again: it adds what is missing (a new Mac), revokes
permissions of these roles the plan no longer lists, sets given passwords again, and leaves
every other user and role alone. Once auth is on, run it with root's credentials
(a certificate with CN=root, or ``--etcd-username root`` and root's password).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from mlx_fleet.contract import ROOT, Keys
from mlx_fleet.etcd_credentials import (CredentialsError, add_etcd_arguments,
                                        credentials_from_args)
from mlx_fleet.etcd_security import Access, plan_auth
from mlx_fleet.exposure import INSECURE_ETCD, etcd_exposure_check


def _user_file(text: str) -> tuple[str, str]:
    user, sep, path = text.partition("=")
    if not sep or not user or not path:
        raise argparse.ArgumentTypeError(f"expected USER=PATH, got {text!r}")
    return user, path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="etcd_command", required=True, metavar="ACTION")
    b = sub.add_parser("bootstrap-auth", help="create users/roles and enable etcd auth",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--etcd-endpoint",
                   default=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", "http://127.0.0.1:2379"),
                   help="etcd client URL, http:// or https:// (env MLX_FLEET_ETCD_ENDPOINT; "
                        "default %(default)s)")
    b.add_argument("--etcd-prefix", default=os.environ.get("MLX_FLEET_ETCD_PREFIX", ROOT),
                   help="key root of the contract (default %(default)s)")
    b.add_argument("--node", action="append", default=[], metavar="NODE",
                   help="a Mac's node name (its agent's --node-name); repeatable")
    b.add_argument("--password-file", action="append", default=[], type=_user_file,
                   metavar="USER=PATH",
                   help="give USER a password read from PATH (e.g. root=/run/secrets/root); "
                        "repeatable; users without one log in by client certificate only")
    b.add_argument("--no-enable", action="store_true",
                   help="create users and roles but leave authentication as it is")
    b.add_argument("--dry-run", action="store_true",
                   help="print the plan (users, roles, permissions) and change nothing")
    b.add_argument(INSECURE_ETCD, action="store_true",
                   help="accept a plain http:// etcd endpoint on a host that is not loopback, "
                        "or passwords (root's login, --password-file) over http://; without "
                        "this flag the command refuses to run")
    add_etcd_arguments(b)
    b.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_auth(Keys(args.etcd_prefix), args.node)
    except ValueError as e:
        print(f"mlx-fleet etcd bootstrap-auth: --node: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for role in plan.roles:
            print(f"role {role.name}")
            for perm in role.permissions:
                print(f"  {Access(perm.access).name:<9} {perm.key}{'*' if perm.prefix else ''}")
        for user in plan.users:
            print(f"user {user.name}: roles {', '.join(user.roles)}")
        return 0
    passwords: dict[str, str] = {}
    known = {u.name for u in plan.users}
    for user, path in args.password_file:
        if user not in known:
            print(f"mlx-fleet etcd bootstrap-auth: --password-file: {user!r} is not a user of "
                  f"the plan ({', '.join(sorted(known))})", file=sys.stderr)
            return 2
        try:
            passwords[user] = open(path, encoding="utf-8").read().rstrip("\r\n")
        except OSError as e:
            print(f"mlx-fleet etcd bootstrap-auth: --password-file {user}={path!r}: cannot read "
                  f"({e.strerror or e})", file=sys.stderr)
            return 2
    try:
        credentials = credentials_from_args(args)
    except CredentialsError as e:
        print(f"mlx-fleet etcd bootstrap-auth: {e}", file=sys.stderr)
        return 2
    exposure = etcd_exposure_check(
        etcd_endpoint=args.etcd_endpoint,
        etcd_password=credentials.password is not None or bool(passwords),
        insecure=frozenset({INSECURE_ETCD} if args.insecure_etcd_http else ()))
    if exposure.refusals:
        print(f"mlx-fleet etcd bootstrap-auth: {exposure.refusals[0]}", file=sys.stderr)
        return 2
    for warning in exposure.warnings:
        print(f"mlx-fleet etcd bootstrap-auth: {warning}", file=sys.stderr)
    return asyncio.run(_apply(args.etcd_endpoint, credentials, plan, passwords,
                              enable=not args.no_enable))


async def _apply(endpoint, credentials, plan, passwords, *, enable: bool) -> int:
    from mlx_fleet.store import EtcdStore, StoreError

    try:
        store = EtcdStore(endpoint, credentials=credentials)
    except ValueError as e:
        print(f"mlx-fleet etcd bootstrap-auth: {e}", file=sys.stderr)
        return 2
    try:
        async with store:
            changes = await store.apply_auth_plan(plan, passwords, enable=enable)
    except StoreError as e:
        print(f"mlx-fleet etcd bootstrap-auth: {e}", file=sys.stderr)
        return 1
    for line in changes or ["nothing to change"]:
        print(line)
    return 0
