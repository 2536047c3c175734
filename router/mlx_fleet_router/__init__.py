"""The fleet router (``mlx-fleet-router``, issue #17): one OpenAI endpoint for the whole fleet.

Its own package beside the operator and the node agent; it imports :mod:`mlx_fleet` (the
routing facts in :mod:`mlx_fleet.routing`), never ``node_agent`` or ``mlx_fleet_operator``
(import-linter contracts in ``pyproject.toml``).

Its pure decisions, one job per module, each a plain function or a small state record and a
pure step over plain data, with ``now`` (seconds of a monotonic clock) passed in ("Pure
decisions import no I/O" contract):

* :mod:`~mlx_fleet_router.picker` — which Macs to try for one request, in order (the canary
  split's revision, then consistent hashing with bounded loads on the session key);
* :mod:`~mlx_fleet_router.breaker` — the circuit breaker of one Mac;
* :mod:`~mlx_fleet_router.retry` — retry on the next Mac or give up, within a retry budget;
* :mod:`~mlx_fleet_router.limits` — per-tenant token buckets and the backpressure queue;
* :mod:`~mlx_fleet_router.table` — the routing table: Ready replicas per served model name;
* :mod:`~mlx_fleet_router.fleet` — what the router routes to, per Mac (``GET /fleet``).

The I/O around them: :mod:`~mlx_fleet_router.follow` (etcd views → the table),
:mod:`~mlx_fleet_router.app` (the aiohttp server), :mod:`~mlx_fleet_router.state` (one
process's breakers, in-flight counts, budget, buckets), :mod:`~mlx_fleet_router.metrics`,
:mod:`~mlx_fleet_router.main` (the ``mlx-fleet-router`` command). ``docs/router.md`` describes
them.
"""
