"""The Kubernetes side of the operator's I/O: the API group's names and the calls the
operator makes outside kopf (a client of its own, merge patches of an object or its status).

Why the ``kubernetes`` client rather than kopf's ``patch``: kopf 1.45 applies a daemon's
``patch`` only when the daemon function returns (``_core/engines/daemons.py``), and the
operator's daemons run forever; so they patch through this client, in a worker thread (the
client blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the client is imported where it is used (it is slow to import)
    from kubernetes.client import CustomObjectsApi

GROUP, VERSION, PLURAL = "mlx-fleet.io", "v1alpha1", "modeldeployments"
CANARY_PLURAL = "canaries"
MACNODE_PLURAL = "macnodes"
FINALIZER = "mlx-fleet.io/finalizer"

__all__ = ["GROUP", "VERSION", "PLURAL", "CANARY_PLURAL", "MACNODE_PLURAL", "FINALIZER",
           "kubernetes_api", "patch_object"]


def kubernetes_api() -> CustomObjectsApi:
    """A client of the custom objects API: the in-cluster service account when running in a
    pod, else ``$KUBECONFIG`` / ``~/.kube/config``. Blocking; raises the client's
    ``ConfigException`` when neither loads."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


async def patch_object(api: CustomObjectsApi, plural: str, namespace: str, name: str,
                       body: Mapping[str, Any], *, status: bool = False) -> None:
    """JSON merge patch of the namespaced object ``plural``/``namespace``/``name`` of
    :data:`GROUP` (``status``: of its ``status`` subresource), in a worker thread. An object
    deleted meanwhile (404) is not an error: there is nothing left to patch. Raises the
    client's ``ApiException`` otherwise."""
    import kubernetes

    def call() -> None:
        patch = (api.patch_namespaced_custom_object_status if status
                 else api.patch_namespaced_custom_object)
        try:
            patch(GROUP, VERSION, namespace, plural, name, dict(body),
                  _content_type="application/merge-patch+json")
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

    await asyncio.to_thread(call)
