"""The routing facts of the fleet, one definition each, shared by the node agent, the operator
and the fleet router — without any of them importing another (an import-linter contract in
``pyproject.toml`` keeps :mod:`mlx_fleet` from importing ``node_agent`` or the operator).

One job per module:

* :mod:`~mlx_fleet.routing.session` — the session key of a request;
* :mod:`~mlx_fleet.routing.split` — its bucket and the canary traffic split (stable or
  candidate);
* :mod:`~mlx_fleet.routing.route` — which loaded revision, or which other node, serves a request
  on an agent;
* :mod:`~mlx_fleet.routing.replicas` — when a replica serves (the Ready predicate) and the
  endpoints of a set of replicas;
* :mod:`~mlx_fleet.routing.names` — served-name conflicts (two deployments claiming one model
  id), refused by the router and shown by the operator;
* :mod:`~mlx_fleet.routing.headers` — the HTTP header names;
* :mod:`~mlx_fleet.routing.fleet` — the shape of a router's ``GET /fleet`` (per Mac: breaker,
  in-flight), which ``mlx-fleet status --router`` reads;
* :mod:`~mlx_fleet.routing.api_keys` — bearer API keys: the key file, the constant-time check;
* :mod:`~mlx_fleet.routing.body_size` — the largest request body and prompt (413 / 400);
* :mod:`~mlx_fleet.routing.proxy` — relaying a request to another server, streaming preserved
  (aiohttp; the only module here that does network I/O).

All but :mod:`~mlx_fleet.routing.proxy` are pure decisions ("Pure decisions import no I/O"
contract).
"""
