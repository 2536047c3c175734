"""``mlx-fleet canary status|promote|abort NAME``: a Canary from the command line.

The model is Argo Rollouts' ``kubectl argo rollouts promote/abort``. The operator acts on
annotations whose *value* is a fresh token (this command writes the current time), so the same
action can be asked again and an action is never replayed by a restart:

* ``promote`` sets ``mlx-fleet.io/promote``: advance past the current step or pause;
* ``promote --full`` sets ``mlx-fleet.io/promote-full``: skip the remaining steps and promote;
* ``abort`` sets ``mlx-fleet.io/abort``: weight 0, the candidate is unloaded, phase Aborted.

``kubectl annotate canary NAME mlx-fleet.io/promote="$(date +%s)" --overwrite`` does the same.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from typing import Any

GROUP, VERSION, PLURAL = "mlx-fleet.io", "v1alpha1", "canaries"
ANNOTATIONS = {"promote": "mlx-fleet.io/promote", "promote-full": "mlx-fleet.io/promote-full",
               "abort": "mlx-fleet.io/abort"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["status", "promote", "abort"],
                   help="status: phase, step, weight and the last analysis; promote: advance "
                        "past the current step (--full: promote now); abort: roll back now")
    p.add_argument("name", help="the Canary's metadata.name")
    p.add_argument("-n", "--namespace", default="default", help="namespace (default: default)")
    p.add_argument("--full", action="store_true", help="with promote: skip every remaining step")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")


def _api(kubeconfig: str | None) -> Any:
    import kubernetes

    kubernetes.config.load_kube_config(config_file=kubeconfig)
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


def request_action(api: Any, namespace: str, name: str, action: str) -> str:
    """Set the annotation of ``action`` (``promote``, ``promote-full``, ``abort``) to a fresh
    token; returns the token. Raises ``kubernetes.client.ApiException`` (404: no such Canary)."""
    token = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    api.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name,
        {"metadata": {"annotations": {ANNOTATIONS[action]: token}}},
        _content_type="application/merge-patch+json")
    return token


def render(obj: dict, console: Any) -> None:
    """Print a Canary's status: one summary line, then the last analysis per check."""
    from rich.table import Table

    spec, st = obj.get("spec") or {}, obj.get("status") or {}
    console.print(f"[bold]{obj['metadata']['name']}[/] → {spec.get('targetRef', {}).get('name')}"
                  f"  phase [bold]{st.get('phase', 'Pending')}[/]  step "
                  f"{st.get('currentStepIndex', 0)}  weight {st.get('currentWeight', 0)}%  "
                  f"stable {st.get('stableRevision') or '-'}  candidate "
                  f"{spec.get('candidate', {}).get('revision')}")
    if st.get("message"):
        console.print(st["message"])
    analysis = st.get("lastAnalysis") or {}
    if analysis.get("checks"):
        table = Table(title=f"last analysis: {analysis.get('verdict')}")
        for col in ("check", "verdict", "stable", "candidate", "threshold"):
            table.add_column(col)
        for c in analysis["checks"]:
            fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
            table.add_row(c.get("name", ""), c.get("verdict", ""), fmt(c.get("stable")),
                          fmt(c.get("candidate")), fmt(c.get("threshold")))
        console.print(table)


def run(args: argparse.Namespace) -> int:
    import kubernetes

    from mlx_fleet.console import make_console

    try:
        api = _api(args.kubeconfig)
        if args.action == "status":
            render(api.get_namespaced_custom_object(GROUP, VERSION, args.namespace, PLURAL,
                                                    args.name), make_console())
            return 0
        action = "promote-full" if args.action == "promote" and args.full else args.action
        request_action(api, args.namespace, args.name, action)
        print(f"canary {args.namespace}/{args.name}: {action} requested")
        return 0
    except kubernetes.client.ApiException as e:
        what = "not found" if e.status == 404 else f"{e.status} {e.reason}"
        print(f"error: canary {args.namespace}/{args.name}: {what}", file=sys.stderr)
        return 1
    except kubernetes.config.ConfigException as e:
        print(f"error: no usable kubeconfig: {e}", file=sys.stderr)
        return 1
