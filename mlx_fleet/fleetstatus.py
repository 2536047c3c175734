"""Fleet status as the etcd contract sees it: nodes, their assignments and the agents' reports —
and, with a fleet router's URL, each Mac's circuit breaker as that router sees it.

:func:`collect` reads the three prefixes once; :func:`fetch_routing` asks a router's
``GET /fleet`` (:class:`mlx_fleet.routing.fleet.FleetRouting`); :func:`summarize` is a pure
function from those records (and the router's view, if any) to table rows; :func:`render`
prints them with rich. ``mlx-fleet status`` and the demo use it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError

from mlx_fleet.capabilities import TASK_TEXT_EMBEDDING, ModelCapabilities
from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, DownloadProgress,
                                Keys, NodeRecord)
from mlx_fleet.quantity import format_bytes
from mlx_fleet.routing.fleet import FleetRouting, RoutedMac
from mlx_fleet.store import KV, Store

K = TypeVar("K")
R = TypeVar("R", NodeRecord, Assignment, AssignmentReport)


@dataclass(frozen=True)
class FleetView:
    """Parsed records; malformed values are counted, not raised."""

    nodes: dict[str, NodeRecord]
    assignments: dict[tuple[str, str, str], Assignment]  # (node, namespace, name)
    reports: dict[tuple[str, str, str], AssignmentReport]
    malformed: int = 0
    revision: int = 0


def _parse(items: list[KV], parse_key: Callable[[str], K | None], record: type[R]) -> tuple[dict[K, R], int]:
    """Records keyed by their parsed key; keys that don't parse are skipped, values that don't
    validate are counted as malformed."""
    out: dict[K, R] = {}
    malformed = 0
    for kv in items:
        ref = parse_key(kv.key)
        if ref is None:
            continue
        try:
            out[ref] = record.from_json(kv.value)
        except ValidationError:
            malformed += 1
    return out, malformed


async def collect(store: Store, keys: Keys) -> FleetView:
    """Read ``nodes/``, ``assignments/`` and ``reports/`` (three range reads)."""
    nodes, bad_nodes = _parse((await store.list(keys.nodes_prefix)).items, keys.parse_node, NodeRecord)
    assignments, bad_assignments = _parse((await store.list(keys.assignments_prefix)).items,
                                          keys.parse_assignment, Assignment)
    last = await store.list(keys.reports_prefix)
    reports, bad_reports = _parse(last.items, keys.parse_report, AssignmentReport)
    return FleetView(nodes, assignments, reports, bad_nodes + bad_assignments + bad_reports, last.revision)


def _download(rep: AssignmentReport | None) -> DownloadProgress | None:
    if rep is None or rep.state != AssignmentState.PREFETCHING:
        return None
    return rep.progress


def capabilities_text(caps: ModelCapabilities | None) -> str:
    """A revision's reported capabilities in a table cell: ``generate`` then what it adds —
    ``tools (PARSER)``, ``json`` (structured outputs), ``logprobs ≤K``, ``n ≤N`` (N > 1) —
    comma-separated; ``embeddings`` for an embedding model (``embed (not served)`` when it
    does not serve them); ``-`` when unknown (None)."""
    if caps is None:
        return "-"
    if caps.task == TASK_TEXT_EMBEDDING:
        return "embeddings" if caps.embeddings else "embed (not served)"
    parts = ["generate"]
    if caps.tool_calling:
        parts.append(f"tools ({caps.tool_parser})" if caps.tool_parser else "tools")
    if caps.structured_outputs:
        parts.append("json")
    if caps.logprobs:
        parts.append(f"logprobs ≤{caps.max_top_logprobs}")
    if caps.max_n > 1:
        parts.append(f"n ≤{caps.max_n}")
    return ", ".join(parts)


def summarize(view: FleetView, routing: FleetRouting | None = None) -> list[dict[str, str]]:
    """One row per node (and per assignment on it): node, chip, memory, health, deployment,
    revision, state, capabilities (:func:`capabilities_text` of its report's), endpoint,
    progress (:meth:`~mlx_fleet.contract.DownloadProgress.text` of a ``Prefetching`` report's
    download, else ``-``). Nodes without assignments get one row with ``-`` fields;
    assignments on nodes that vanished are listed with node health ``Gone``.

    With ``routing`` (a router's ``GET /fleet``), every row also has ``breaker``
    (:func:`breaker_text` of its node's Mac, ``-`` for a node the router does not route to) and
    ``in-flight`` (that router's requests in flight to the Mac, all deployments; ``-``
    likewise); a Mac the router routes to that etcd does not list gets a row of its own, after
    the others, with ``-`` in the etcd columns."""
    return [row for row, _ in _rows(view, routing)]


def breaker_text(mac: RoutedMac | None) -> str:
    """A Mac's breaker for a table cell: ``closed``; ``open (REASON, half-open in N s)`` (N
    rounded up to whole seconds); ``half-open (REASON, trial out)`` while its one trial is out,
    else ``half-open (REASON)``; ``-`` for None (the router does not route to it)."""
    if mac is None:
        return "-"
    details = [mac.reason] if mac.reason else []
    if mac.state == "open" and mac.half_open_in_seconds is not None:
        details.append(f"half-open in {math.ceil(mac.half_open_in_seconds)} s")
    if mac.state == "half-open" and mac.trial_in_flight:
        details.append("trial out")
    if mac.state == "closed" or not details:
        return mac.state
    return f"{mac.state} ({', '.join(details)})"


def _rows(view: FleetView, routing: FleetRouting | None = None
          ) -> list[tuple[dict[str, str], DownloadProgress | None]]:
    """:func:`summarize`'s rows, each with the download shown in its progress cell."""
    rows = _etcd_rows(view)
    if routing is None:
        return rows
    macs = {m.node: m for m in routing.macs}
    listed = {row["node"] for row, _ in rows}
    rows += [({"node": node, "chip": "-", "memory": "-", "health": "-", "deployment": "-",
               "revision": "-", "state": "-", "capabilities": "-", "endpoint": "-",
               "progress": "-"}, None)
             for node in sorted(set(macs) - listed)]
    return [({**row, "breaker": breaker_text(macs.get(row["node"])),
              "in-flight": (str(macs[row["node"]].in_flight) if row["node"] in macs else "-")}, p)
            for row, p in rows]


def _etcd_rows(view: FleetView) -> list[tuple[dict[str, str], DownloadProgress | None]]:
    """The rows of the etcd records alone."""
    rows: list[tuple[dict[str, str], DownloadProgress | None]] = []
    names = sorted(set(view.nodes) | {ref[0] for ref in view.assignments})
    for node in names:
        rec = view.nodes.get(node)
        base = {
            "node": node,
            "chip": (f"{rec.capacity.chip}{' (simulated)' if rec.capacity.simulated else ''}"
                     if rec else "-"),
            "memory": (f"{format_bytes(rec.capacity.memory_available_bytes)} free / "
                       f"{format_bytes(rec.capacity.memory_total_bytes)}" if rec else "-"),
            "health": rec.health.value if rec else "Gone",
        }
        refs = sorted(ref for ref in view.assignments if ref[0] == node)
        if not refs:
            rows.append(({**base, "deployment": "-", "revision": "-", "state": "-",
                          "capabilities": "-", "endpoint": "-", "progress": "-"}, None))
        for ref in refs:
            a = view.assignments[ref]
            rep = view.reports.get(ref)
            p = _download(rep)
            rows.append(({**base, "deployment": f"{a.namespace}/{a.name}", "revision": (a.source.revision if a.role.value == "Stable" else f"{a.source.revision} ({a.role.value.lower()})"),
                         "state": (rep.state.value + (f" ({rep.reason})" if rep.reason else "")) if rep
                         else "Pending",
                         "capabilities": capabilities_text(rep.capabilities if rep else None),
                         "endpoint": rep.endpoint if rep and rep.endpoint else "-",
                         "progress": p.text() if p is not None else "-"}, p))
    return rows


_COLUMNS = ("node", "chip", "memory", "health", "deployment", "revision", "state",
            "capabilities", "endpoint", "breaker", "in-flight", "progress")


def _progress_cell(p: DownloadProgress, text: str):
    """A rich bar (bytes done of total; pulsing while the total is unknown) above its text."""
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    cell = Table.grid()
    cell.add_row(ProgressBar(total=p.bytes_total or None, completed=p.bytes_done))
    cell.add_row(text)
    return cell


def render(view: FleetView, console=None, routing: FleetRouting | None = None) -> None:
    """Print :func:`summarize` as a rich table; the Progress column (a bar over its text)
    appears while some assignment is Prefetching, the Breaker and In-flight columns with
    ``routing``."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"mlx-fleet (etcd revision {view.revision})")
    rows = _rows(view, routing)
    # the progress column only while something downloads, the router's only with its view
    router_columns = ("breaker", "in-flight")
    columns = [c for c in _COLUMNS if (routing is not None or c not in router_columns)
               and (c != "progress" or any(p is not None for _, p in rows))]
    for col in columns:
        table.add_column(col.capitalize())
    for row, p in rows:
        cells = [row[c] for c in columns]
        if "progress" in columns and p is not None:
            cells[-1] = _progress_cell(p, row["progress"])
        table.add_row(*cells)
    console.print(table)
    if view.malformed:
        console.print(f"[yellow]{view.malformed} malformed record(s) ignored[/]")


class RouterUnavailable(Exception):
    """A fleet router's ``GET /fleet`` gave no view; ``str()`` is one line naming the URL and
    why."""


async def fetch_routing(url: str, *, key: str | None = None,
                        timeout_seconds: float = 5.0) -> FleetRouting:
    """Ask the router at ``url`` (base URL) for ``GET /fleet``, with ``key`` as its bearer API
    key when given; at most ``timeout_seconds`` in all. Raises :class:`RouterUnavailable`:
    cannot connect or timed out, 401 (a key is needed or was refused), 404 (a router without
    ``/fleet``), any other status, or an answer not of the
    :class:`~mlx_fleet.routing.fleet.FleetRouting` shape."""
    import asyncio

    import aiohttp

    base = url.rstrip("/")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout_seconds)) as s:
            async with s.get(f"{base}/fleet", headers=headers) as r:
                body = await r.read()
                status = r.status
    except asyncio.TimeoutError:
        raise RouterUnavailable(f"router {base}: no answer within {timeout_seconds:g} s") from None
    except aiohttp.ClientError as e:
        raise RouterUnavailable(f"router {base}: cannot connect ({e})") from None
    if status == 401:
        raise RouterUnavailable(f"router {base}: 401, its API key is required or was refused "
                                "(--router-key-file)")
    if status == 404:
        raise RouterUnavailable(f"router {base}: no /fleet endpoint (an older router?)")
    if status != 200:
        raise RouterUnavailable(f"router {base}: HTTP {status} from /fleet")
    try:
        return FleetRouting.model_validate(json.loads(body))
    except (ValueError, ValidationError):
        raise RouterUnavailable(f"router {base}: /fleet answered something else than its "
                                "fleet document") from None
