"""``mlx-fleet-operator``: the command line that runs the kopf operator programmatically."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import socket
import uuid
import sys
import urllib.parse
from collections.abc import Mapping, Sequence

from mlx_fleet.contract import ROOT
from mlx_fleet.etcd_credentials import EtcdCredentials, add_etcd_arguments, credentials_from_args
from mlx_fleet.exposure import INSECURE_ETCD, etcd_exposure_check
from mlx_fleet.source_policy import PolicyError, SourcePolicy
from mlx_fleet.source_policy_file import ENV_SOURCE_POLICY, load_policy
from mlx_fleet.store import check_endpoint, parse_endpoint

DESCRIPTION = """\
Run the mlx-fleet operator: turn ModelDeployment resources (mlx-fleet.io/v1alpha1) into
per-Mac assignments in etcd, and the node agents' reports back into status and events.
Kubernetes access: $KUBECONFIG (or ~/.kube/config), or the in-cluster service account.
Stops cleanly on SIGTERM or SIGINT. Exits 2 with one line on stderr when the Kubernetes
configuration cannot be loaded or the metrics port cannot be bound (checked before anything
else starts), and non-zero when the start-up handler fails (etcd unreachable, ...).
"""

#: Exit status of a failed pre-flight check (bad configuration: retrying will not help).
EXIT_PREFLIGHT = 2
#: Exit status when the operator stopped on an error after it started (start-up handler failed).
EXIT_FAILED = 1


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _etcd_endpoint(text: str) -> str:
    """argparse type: an etcd client URL the store accepts (``http://host:port``)."""
    try:
        parse_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _router_url(text: str) -> str:
    """argparse type: the fleet router's base URL (``http(s)://host[:port][/path]``), without a
    trailing slash."""
    u = urllib.parse.urlsplit(text)
    if u.scheme not in ("http", "https") or not u.netloc or u.query or u.fragment:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http:// or https:// base URL (e.g. http://mlx-fleet-router:8080)")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlx-fleet-operator", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--etcd-endpoint", type=_etcd_endpoint,
                   default=os.environ.get("MLX_FLEET_ETCD_ENDPOINT", "http://127.0.0.1:2379"),
                   help="etcd client URL (http://host:port, or https://host:port with "
                        "--etcd-ca-file) holding node records, assignments "
                        "and reports (env MLX_FLEET_ETCD_ENDPOINT; default %(default)s)")
    p.add_argument("--etcd-prefix", default=os.environ.get("MLX_FLEET_ETCD_PREFIX", ROOT),
                   help="key root of the etcd contract; the agents must use the same one "
                        "(env MLX_FLEET_ETCD_PREFIX; default %(default)s)")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="watch ModelDeployments only in this namespace (repeatable; glob "
                        "patterns allowed); default: all namespaces (cluster-wide)")
    p.add_argument("--router-url", type=_router_url,
                   default=os.environ.get("MLX_FLEET_ROUTER_URL") or None, metavar="URL",
                   help="the fleet router's base URL clients use (the chart's router Service); "
                        "shown with each ModelDeployment's served model name in its "
                        "status.router (env MLX_FLEET_ROUTER_URL; default: none, no "
                        "status.router)")
    p.add_argument("--source-policy", default=os.environ.get(ENV_SOURCE_POLICY),
                   metavar="FILE|JSON",
                   help="the fleet's model source policy (a JSON/YAML file, or inline JSON "
                        "starting with '{'; give every agent the same): a ModelDeployment or "
                        "Canary whose source it refuses gets no assignment and the condition "
                        "SourceAllowed=False (docs/security.md, 'Source policy'; env "
                        f"{ENV_SOURCE_POLICY}; default: the secure policy, https:// and hf:// "
                        "only, no local directories, no private addresses)")
    p.add_argument("--metrics-port", type=int, default=8080,
                   help="port of the Prometheus /metrics endpoint on 0.0.0.0; 0 disables it "
                        "(default %(default)s)")
    p.add_argument("--liveness-port", type=int, default=8081,
                   help="port of the liveness endpoint http://0.0.0.0:PORT/healthz; 0 disables "
                        "it (default %(default)s)")
    p.add_argument("--gc-interval", type=_positive_seconds, default=60.0, metavar="SECONDS",
                   help="seconds between garbage collections of orphaned assignments (their "
                        "ModelDeployment is gone); the first runs at start-up "
                        "(default %(default)s)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--standalone", dest="standalone", action="store_true", default=True,
                         help="run without kopf peering (the default): safety against two "
                              "operator replicas comes from the fenced etcd transactions, so "
                              "no KopfPeering CRD or its RBAC is needed")
    peering.add_argument("--peering", dest="standalone", action="store_false",
                         help="use kopf peering, mandatory (the operator fails to start without "
                              "kopf's peering CRDs and the peering object --peering-name): only "
                              "the replica with the highest --peering-priority handles "
                              "resources, the others pause until its record expires")
    p.add_argument("--peering-name", default="mlx-fleet", metavar="NAME",
                   help="with --peering: the ClusterKopfPeering (cluster-wide) or KopfPeering "
                        "(in each watched namespace) object the replicas share "
                        "(default %(default)s)")
    p.add_argument("--peering-priority", type=int, default=None, metavar="N",
                   help="with --peering: this replica's priority; default a random number "
                        "per process, so replicas differ (kopf pauses ALL operators that see "
                        "an equal priority)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="debug logging (kopf and mlx-fleet)")
    g = p.add_argument_group("insecure opt-outs (docs/security.md, 'Secure defaults')")
    g.add_argument(INSECURE_ETCD, action="store_true",
                   help="accept a plain http:// etcd endpoint on a host that is not loopback, "
                        "or an etcd password over http://; without this flag the operator "
                        "refuses to start")
    add_etcd_arguments(p)
    return p


class PreflightError(Exception):
    """A start-up check failed; the message is the one line printed."""


def load_kubernetes_config() -> None:
    """Load the Kubernetes client configuration the way the operator does at start-up: the
    in-cluster service account when running in a pod, else ``$KUBECONFIG`` / ``~/.kube/config``.
    Raises :class:`PreflightError` naming what was tried."""
    import kubernetes

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            kubernetes.config.load_incluster_config()
            return
        except Exception as e:  # fall back to a kubeconfig, like the handlers do
            in_cluster = f"in-cluster service account: {e}; "
    else:
        in_cluster = ""
    where = (f"KUBECONFIG={os.environ['KUBECONFIG']}" if os.environ.get("KUBECONFIG")
             else "~/.kube/config")
    try:
        kubernetes.config.load_kube_config()
    except Exception as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PreflightError(f"cannot load the Kubernetes configuration ({in_cluster}"
                             f"kubeconfig {where}): {detail}") from None


def preflight(args: argparse.Namespace) -> None:
    """Checks that would otherwise fail inside kopf's start-up handler (where kopf logs a
    traceback and retries forever): Kubernetes configuration, then the metrics port (bound
    here and kept: this is the metrics server). Raises :class:`PreflightError`."""
    load_kubernetes_config()
    if args.metrics_port:
        from . import metrics

        try:
            metrics.serve(args.metrics_port)
        except OSError as e:
            raise PreflightError(f"cannot serve metrics on port {args.metrics_port} "
                                 f"(--metrics-port): {e.strerror or e}") from None


def load_etcd_credentials(args: argparse.Namespace) -> EtcdCredentials:
    """The ``--etcd-*`` TLS/auth flags read and checked against ``--etcd-endpoint`` (its
    exposure is :func:`check_etcd_exposure`'s); raises :class:`PreflightError` with one line
    naming the flag (never a file's contents)."""
    try:
        credentials = credentials_from_args(args)
        check_endpoint(args.etcd_endpoint, credentials)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    return credentials


def check_etcd_exposure(args: argparse.Namespace, credentials: EtcdCredentials) -> tuple[str, ...]:
    """:func:`mlx_fleet.exposure.etcd_exposure_check` of ``--etcd-endpoint`` and the password:
    raises :class:`PreflightError` with the refusal (a non-loopback ``http://`` etcd, or a
    password over ``http://``, without ``--insecure-etcd-http``); returns the accepted risks'
    warnings, for the caller to log at start."""
    exposure = etcd_exposure_check(
        etcd_endpoint=args.etcd_endpoint, etcd_password=credentials.password is not None,
        insecure=frozenset({INSECURE_ETCD} if args.insecure_etcd_http else ()))
    if exposure.refusals:
        raise PreflightError(exposure.refusals[0])
    return exposure.warnings


def kopf_run_kwargs(args: argparse.Namespace) -> dict:
    """``kopf.run`` arguments for scope and peering. ``--peering`` passes a peering name, which
    makes kopf's peering *mandatory* (without one kopf merely auto-detects the "default"
    object and, finding none, runs every replica standalone)."""
    # Always our own identity, standalone too: kopf's would come from getpass.getuser(), which
    # raises KeyError for a uid with no passwd entry (the image's 65532 under the chart's
    # runAsUser: a crash loop at start). The operator also reads the peering objects, to export
    # the fleet metrics only while it is the active peer (.peering).
    kw: dict = dict(clusterwide=not args.namespace, namespaces=args.namespace,
                    identity=own_identity(os.environ))
    if args.standalone:
        return {**kw, "standalone": True}
    priority = (args.peering_priority if args.peering_priority is not None
                else random.SystemRandom().randint(1, 2**31 - 1))
    return {**kw, "standalone": False, "peering_name": args.peering_name, "priority": priority}


def own_identity(environ: Mapping[str, str]) -> str:
    """This operator process's kopf peering identity, ``"<pod or host>/<pid>/<8 hex>"``: the
    Pod's name from the chart's Downward-API ``POD_NAME`` (else the host name, which is the
    node's under ``hostNetwork``), the pid (1 in every container) and a random suffix, so two
    replicas never share one. Reads no passwd database."""
    who = environ.get("POD_NAME") or socket.gethostname()
    return f"{who}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _source_policy(value: str | None) -> SourcePolicy:
    """``--source-policy`` → the policy; a malformed one is a :class:`PreflightError`."""
    try:
        return load_policy(value)
    except PolicyError as e:
        raise PreflightError(f"--source-policy: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the operator until signalled.
    Returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        etcd_credentials = load_etcd_credentials(args)
        # refuses an exposed etcd; returns the warnings of the risks accepted with a flag
        exposure_warnings = check_etcd_exposure(args, etcd_credentials)
        source_policy = _source_policy(args.source_policy)
        preflight(args)
    except PreflightError as e:
        print(f"mlx-fleet-operator: error: {e}", file=sys.stderr)
        return EXIT_PREFLIGHT
    import kopf

    try:  # kopf 1.45 does not re-export it; if a later kopf moves it, kopf's own error shows
        from kopf._core.engines.activities import ActivityError
    except ImportError:  # pragma: no cover - depends on the installed kopf
        ActivityError = ()  # type: ignore[assignment,misc]  # `except ()` catches nothing

    from . import canary_handlers, handlers  # noqa: F401 - importing registers the handlers
    from .config import OperatorConfig, PeeringConfig

    config = OperatorConfig(etcd_endpoint=args.etcd_endpoint,
                            etcd_credentials=etcd_credentials,
                            etcd_prefix=args.etcd_prefix,
                            metrics_port=args.metrics_port,
                            metrics_served=bool(args.metrics_port),  # by preflight()
                            namespaces=tuple(args.namespace),
                            gc_interval=args.gc_interval,
                            router_url=args.router_url, source_policy=source_policy)
    run_kwargs = kopf_run_kwargs(args)
    if not args.standalone:
        config = dataclasses.replace(
            config, peering=PeeringConfig(
                name=args.peering_name, identity=run_kwargs["identity"],
                priority=run_kwargs["priority"], clusterwide=run_kwargs["clusterwide"]))
    kopf.configure(verbose=args.verbose)
    logging.getLogger("mlx_fleet_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    for warning in exposure_warnings:
        logging.getLogger("mlx_fleet_operator").warning("%s", warning)
    liveness = (f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None)
    try:
        # the configuration reaches the start-up handler in kopf's operator memo
        kopf.run(**run_kwargs, liveness_endpoint=liveness, memo=kopf.Memo(config=config))
    except ActivityError as e:  # the start-up handler failed permanently (already logged)
        causes = "; ".join(str(o.exception) for o in e.outcomes.values() if o.exception)
        print(f"mlx-fleet-operator: error: start-up failed: {causes or e}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
