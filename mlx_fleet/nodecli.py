"""``mlx-fleet cordon|uncordon|drain NODE``: cordon or drain a Mac (like ``kubectl cordon`` /
``kubectl drain``).

All three edit the Mac's cluster-scoped ``MacNode`` (the operator creates one per registered
Mac):

* ``cordon`` sets ``spec.unschedulable``: the Mac takes no new replicas; the ones it serves stay.
  ``kubectl patch macnode NODE --type merge -p '{"spec":{"unschedulable":true}}'`` does the same.
* ``drain`` sets ``spec.unschedulable`` and ``spec.drain``: the operator places every replica on
  the Mac elsewhere first, removes each once its replacement is Ready (the agent lets running
  requests finish, then unloads), and reports in the MacNode's ``Drained`` condition. The
  command waits for that condition — for the MacNode's own generation — to turn True, showing
  what is left, and exits 1 with a one-line reason after ``--timeout`` seconds (e.g. nowhere else
  fits: those replicas keep serving on the Mac, which stays cordoned and draining).
* ``uncordon`` clears both.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping
from typing import Any

GROUP, VERSION, PLURAL = "mlx-fleet.io", "v1alpha1", "macnodes"
#: Default ``--timeout`` of ``mlx-fleet drain`` in seconds (``kubectl drain`` waits forever by
#: default; a bounded wait ends with the reason instead: a model load takes minutes at most).
DRAIN_TIMEOUT_SECONDS = 300.0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("node", help="the Mac's node name (kubectl get macnodes)")
    p.add_argument("--kubeconfig", default=None,
                   help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")


def add_drain_arguments(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.add_argument("--timeout", type=_positive_seconds, default=DRAIN_TIMEOUT_SECONDS, metavar="S",
                   help=f"seconds to wait for the drain (default {DRAIN_TIMEOUT_SECONDS:.0f})")


def _api(kubeconfig: str | None) -> Any:
    import kubernetes

    kubernetes.config.load_kube_config(config_file=kubeconfig)
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient())


def set_spec(api: Any, node: str, **spec: bool) -> dict[str, Any]:
    """Merge-patch ``spec`` (``unschedulable``, ``drain``) of MacNode ``node``; returns the
    object. Raises ``kubernetes.client.ApiException`` (404: no such MacNode; 422: the CRD's
    rule that ``drain`` requires ``unschedulable``)."""
    return api.patch_cluster_custom_object(GROUP, VERSION, PLURAL, node, {"spec": spec},
                                           _content_type="application/merge-patch+json")


def set_unschedulable(api: Any, node: str, unschedulable: bool) -> None:
    """Cordon (True: a drain under way goes on) or uncordon (False: ends a drain too)."""
    if unschedulable:
        set_spec(api, node, unschedulable=True)
    else:
        set_spec(api, node, unschedulable=False, drain=False)


@dataclasses.dataclass(frozen=True)
class DrainProgress:
    """What a MacNode says of its drain. ``observed``: the operator's ``Drained`` condition is
    for ``generation`` or later; ``done``: it is True; ``left``: models still assigned;
    ``reason``/``message``: the condition's (``"Pending"`` until it is observed)."""

    observed: bool
    done: bool
    left: int
    reason: str
    message: str


def drain_progress(obj: Mapping[str, Any], generation: int) -> DrainProgress:
    """Read the drain's progress from a MacNode object (pure)."""
    status = obj.get("status") or {}
    cond = next((c for c in status.get("conditions") or []
                 if isinstance(c, Mapping) and c.get("type") == "Drained"), None)
    left = int(status.get("modelCount") or 0)
    if cond is None or int(cond.get("observedGeneration") or 0) < generation:
        return DrainProgress(False, False, left, "Pending",
                             "waiting for the operator to see the drain request")
    return DrainProgress(True, cond.get("status") == "True", left, str(cond.get("reason", "")),
                         str(cond.get("message", "")))


def wait_drained(api: Any, node: str, generation: int, timeout: float,
                 on_progress: Any = lambda p: None) -> DrainProgress:
    """Follow MacNode ``node`` with a watch until its drain is done or ``timeout`` seconds
    pass; returns the last :class:`DrainProgress`. ``on_progress`` is called with each one."""
    import kubernetes

    deadline = time.monotonic() + timeout
    last = DrainProgress(False, False, 0, "Pending", "no MacNode event seen")
    w = kubernetes.watch.Watch()
    while (remaining := deadline - time.monotonic()) > 0:
        for ev in w.stream(api.list_cluster_custom_object, GROUP, VERSION, PLURAL,
                           field_selector=f"metadata.name={node}",
                           timeout_seconds=max(int(remaining), 1),
                           _request_timeout=remaining + 5):
            if ev.get("type") == "DELETED":
                return DrainProgress(True, False, last.left, "Deleted",
                                     "the MacNode was deleted")
            last = drain_progress(ev["object"], generation)
            on_progress(last)
            if last.done:
                w.stop()
                return last
            if time.monotonic() >= deadline:
                w.stop()
                break
    return last


def drain(api: Any, node: str, timeout: float, console: Any) -> int:
    """``mlx-fleet drain``: request the drain, then wait (module docstring). Returns the exit
    code."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    obj = set_spec(api, node, unschedulable=True, drain=True)
    generation = int(obj["metadata"].get("generation") or 0)
    console.print(f"macnode/{node} cordoned; draining", highlight=False)
    first = drain_progress(obj, 0).left
    with Progress(TextColumn("[bold]draining {task.fields[node]}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("replicas moved"), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("", total=max(first, 1), node=node)
        shown: list[str] = []

        def show(p: DrainProgress) -> None:
            total = max(first, p.left, 1)
            bar.update(task, total=total, completed=total - p.left if not p.done else total,
                       description=p.reason)
            line = f"{p.reason}: {p.message}"
            if not console.is_terminal and (not shown or shown[-1] != line):
                console.print(line, highlight=False)
            shown.append(line)

        last = wait_drained(api, node, generation, timeout, show)
    if last.done:
        console.print(f"macnode/{node} drained", highlight=False)
        return 0
    print(f"error: drain of {node} not done after {timeout:g}s: {last.reason}: "
          f"{last.message}".replace("\n", " "), file=sys.stderr)
    return 1


def run(args: argparse.Namespace) -> int:
    import kubernetes

    try:
        api = _api(args.kubeconfig)
        if args.command == "drain":
            from mlx_fleet.console import make_console

            return drain(api, args.node, args.timeout, make_console())
        cordon = args.command == "cordon"
        set_unschedulable(api, args.node, cordon)
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
