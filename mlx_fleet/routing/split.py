"""The canary traffic split: which revision of a deployment serves one request.

Issue #5: "Per request the agent picks stable or candidate by a stable hash of a session key —
the X-Session-ID header, else the OpenAI user field, else a random key for that request — into
10 000 buckets; bucket < weight × 100 → candidate. hashlib, never Python's salted hash().
Deterministic across nodes and restarts, sticky, monotone."

* deterministic and sticky: :func:`bucket` depends only on the deployment and the key (SHA-256,
  not ``hash()``), so every node, before and after a restart, sends a session to the same side;
* monotone: the candidate's buckets at weight *w* are ``[0, w × 100)``, a prefix of those at any
  larger weight, so raising the weight only moves sessions stable → candidate, never back;
* independent per deployment: the deployment is hashed with the key, so one session is not on
  the candidate side of every canary at once.

The session key itself (header, else ``user``, else random) is
:func:`mlx_fleet.routing.session.session_key`'s. Pure: standard library and
:mod:`mlx_fleet.contract` only.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Literal

from mlx_fleet.contract import SPLIT_BUCKETS, TrafficSplit

__all__ = ["Choice", "bucket", "choose", "is_active"]

SplitRole = Literal["stable", "candidate"]


def bucket(deployment: str, key: str) -> int:
    """The session bucket of ``key`` for ``deployment``, in ``[0, SPLIT_BUCKETS)``.

    ``SHA-256(len(d) ‖ d ‖ len(k) ‖ k)`` over the UTF-8 bytes ``d`` and ``k``, each length an
    8-byte big-endian integer (so ``("ns/a", "bc")`` and ``("ns/ab", "c")`` differ); the first
    8 digest bytes, big-endian, modulo ``SPLIT_BUCKETS``. Bias of the modulo: 2**64 is not a
    multiple of 10 000, so some buckets get one preimage more than others out of ~1.8e15 each,
    a relative excess below 10 000 / 2**64 ≈ 5.4e-16.
    """
    h = hashlib.sha256()
    for part in (deployment.encode(), key.encode()):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return int.from_bytes(h.digest()[:8], "big") % SPLIT_BUCKETS


def is_active(split: TrafficSplit | None) -> bool:
    """True when ``split`` sends some sessions to a candidate: it names a candidate revision
    and its weight is above 0. Otherwise every request is the stable side's (or, without a
    split, the node's own choice)."""
    return split is not None and bool(split.candidate_revision) and split.weight > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """The outcome for one request. ``revision``: the revision to serve, ``""`` when there is no
    split (the node serves its Stable revision, or a Previous one until Stable is Ready there).
    ``bucket``: the key's bucket for this deployment, ``None`` without a split."""

    revision: str
    role: SplitRole
    bucket: int | None


def choose(split: TrafficSplit | None, key: str, *, guard_tripped: bool = False) -> Choice:
    """Stable or candidate for the session ``key`` (issue #5: "bucket < weight × 100 →
    candidate"). No split, weight 0 or a tripped local guard → stable. The deployment identity
    hashed with the key is ``f"{split.namespace}/{split.name}"``."""
    if split is None:
        return Choice(revision="", role="stable", bucket=None)
    b = bucket(f"{split.namespace}/{split.name}", key)
    if not guard_tripped and b < split.weight * (SPLIT_BUCKETS // 100):
        return Choice(revision=split.candidate_revision, role="candidate", bucket=b)
    return Choice(revision=split.stable_revision, role="stable", bucket=b)
