"""Least-privilege etcd roles for mlx-fleet: a pure plan of users, roles and permissions.

:func:`plan_auth` turns the contract's key layout (:class:`mlx_fleet.contract.Keys`) and the
list of Macs into an :class:`AuthPlan`; ``mlx-fleet etcd bootstrap-auth`` (:mod:`mlx_fleet.etcdcli`)
applies it through etcd's auth API (:meth:`mlx_fleet.store.EtcdStore.apply_auth_plan`).
:func:`allowed` evaluates a plan the way etcd evaluates permissions (a user may do what any of
its roles grants; ``root`` may do everything), so the plan is tested without a cluster.

The roles (docs/security.md):

* ``mlx-fleet-operator``: read and write the whole key root (it writes ``assignments/``,
  ``traffic/`` and ``placement-epoch`` and reads everything);
* ``mlx-fleet-agent-<node>``, one per Mac: read-write its own ``nodes/<node>`` key and its own
  ``reports/<node>/`` and ``stats/<node>/`` prefixes; read its own ``assignments/<node>/``
  prefix and the ``traffic/`` prefix (the routing weights it needs to forward requests).
  Leases need no key permission in etcd (granting and keeping alive are allowed to any
  authenticated user; attaching one to a key needs write permission on that key);
* ``mlx-fleet-router``: read only, the prefixes the fleet router follows — ``nodes/``,
  ``assignments/``, ``reports/``, ``traffic/`` and ``stats/`` (issue #17: any number of
  stateless router replicas, none able to change the fleet).

A user of the same name as its role holds it; with etcd's ``--client-cert-auth`` the client
certificate's Common Name is the user, so certificates are issued with ``CN=<user name>``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

from mlx_fleet.contract import Keys

ROOT_USER = "root"
"""etcd's superuser; it must exist (with the built-in ``root`` role) before auth is enabled."""
OPERATOR_USER = "mlx-fleet-operator"
"""User and role name of the operator."""
ROUTER_USER = "mlx-fleet-router"
"""User and role name of the fleet router (every replica shares it)."""
AGENT_USER_PREFIX = "mlx-fleet-agent-"
"""Prefix of the per-Mac agent user and role names: ``mlx-fleet-agent-<node>``."""


class Access(enum.IntEnum):
    """etcd's ``authpb.Permission.Type`` (same numbers: READ 0, WRITE 1, READWRITE 2)."""

    READ = 0
    WRITE = 1
    READWRITE = 2

    def permits(self, op: str) -> bool:
        """``op``: ``"read"`` or ``"write"``."""
        return self is Access.READWRITE or (self is Access.READ) == (op == "read")


@dataclasses.dataclass(frozen=True, order=True)
class Permission:
    """``access`` to ``key`` alone, or to every key starting with ``key`` when ``prefix``."""

    key: str
    prefix: bool
    access: Access

    def covers(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key


@dataclasses.dataclass(frozen=True)
class Role:
    name: str
    permissions: tuple[Permission, ...]


@dataclasses.dataclass(frozen=True)
class User:
    """``name`` (= client certificate CN) holding ``roles``."""

    name: str
    roles: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AuthPlan:
    """Every role and user mlx-fleet needs, plus ``root``. Applying it is idempotent:
    missing roles, users, grants and permissions are added, permissions of these roles
    that the plan does not list are revoked; other roles and users are left alone."""

    roles: tuple[Role, ...]
    users: tuple[User, ...]

    def role(self, name: str) -> Role:
        return next(r for r in self.roles if r.name == name)

    def user(self, name: str) -> User:
        return next(u for u in self.users if u.name == name)


def agent_user(node: str) -> str:
    """The etcd user (and role, and certificate CN) of the agent on ``node``."""
    return f"{AGENT_USER_PREFIX}{node}"


def agent_role(keys: Keys, node: str) -> Role:
    """The permissions of the agent on ``node`` (raises ``ValueError`` for a bad node name)."""
    rw, ro = Access.READWRITE, Access.READ
    return Role(agent_user(node), (
        Permission(keys.node(node), False, rw),
        Permission(keys.node_reports_prefix(node), True, rw),
        Permission(keys.node_stats_prefix(node), True, rw),
        Permission(keys.node_assignments_prefix(node), True, ro),
        Permission(keys.traffic_prefix, True, ro),
    ))


def operator_role(keys: Keys) -> Role:
    """Read-write on the whole key root (``<root>/`` and the root key itself is unused)."""
    return Role(OPERATOR_USER, (Permission(f"{keys.root}/", True, Access.READWRITE),))


def router_role(keys: Keys) -> Role:
    """Read-only on the prefixes the fleet router follows (node records, assignments, reports,
    traffic splits, stats reports); nothing else, no write anywhere."""
    return Role(ROUTER_USER, tuple(
        Permission(prefix, True, Access.READ)
        for prefix in (keys.nodes_prefix, keys.assignments_prefix, keys.reports_prefix,
                       keys.traffic_prefix, keys.stats_prefix)))


def plan_auth(keys: Keys, nodes: Iterable[str]) -> AuthPlan:
    """The plan for the operator, the fleet router and one agent per name in ``nodes``
    (duplicates ignored, order kept). Raises ``ValueError`` naming a node that is not a valid
    key segment."""
    unique = list(dict.fromkeys(nodes))
    roles = [operator_role(keys), router_role(keys), *(agent_role(keys, n) for n in unique)]
    users = [User(ROOT_USER, ("root",)), *(User(r.name, (r.name,)) for r in roles)]
    return AuthPlan(roles=tuple(roles), users=tuple(users))


def allowed(plan: AuthPlan, user: str, op: str, key: str) -> bool:
    """Would etcd let ``user`` (one of the plan's) ``op`` (``"read"``/``"write"``) ``key``?"""
    u = next((x for x in plan.users if x.name == user), None)
    if u is None:
        return False
    if "root" in u.roles:
        return True
    perms: Sequence[Permission] = [p for r in plan.roles if r.name in u.roles for p in r.permissions]
    return any(p.covers(key) and p.access.permits(op) for p in perms)
