"""``mlx-fleet cordon|uncordon NODE``: cordon a Mac (like ``kubectl cordon``).

Sets ``spec.unschedulable`` of the Mac's cluster-scoped ``MacNode`` (the operator creates one
per registered Mac). A cordoned Mac takes no new replicas; the ones it serves stay.
``kubectl patch macnode NODE --type merge -p '{"spec":{"unschedulable":true}}'`` does the same.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

GROUP, VERSION, PLURAL = "mlx-fleet.io", "v1alpha1", "macnodes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", help="the Mac's node name (kubectl get macnodes)")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")


def _api(kubeconfig: str | None) -> Any:
    import kubernetes

    kubernetes.config.load_kube_config(config_file=kubeconfig)
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


def set_unschedulable(api: Any, node: str, unschedulable: bool) -> None:
    """Patch ``spec.unschedulable`` of MacNode ``node``. Raises
    ``kubernetes.client.ApiException`` (404: no such MacNode)."""
    api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, node,
                                    {"spec": {"unschedulable": unschedulable}},
                                    _content_type="application/merge-patch+json")


def run(args: argparse.Namespace) -> int:
    import kubernetes

    cordon = args.command == "cordon"
    try:
        set_unschedulable(_api(args.kubeconfig), args.node, cordon)
    except kubernetes.client.ApiException as e:
        if e.status == 404:
            print(f"error: macnode {args.node!r} not found (kubectl get macnodes lists the "
                  "registered Macs)", file=sys.stderr)
        else:
            print(f"error: macnode {args.node}: {e.status} {e.reason}", file=sys.stderr)
        return 1
    except kubernetes.config.ConfigException as e:
        print(f"error: no usable kubeconfig: {e}", file=sys.stderr)
        return 1
    print(f"macnode/{args.node} {'cordoned' if cordon else 'uncordoned'}")
    return 0
