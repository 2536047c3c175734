"""The ``hf://`` source: a Hugging Face Hub repository fetched into the Hugging Face cache.

``hf://<org>/<repo>[@<revision>]``, through ``huggingface_hub.snapshot_download`` and its cache
(``blobs/``, ``snapshots/<commit>/``, ``refs/<branch-or-tag>``; directory ``hf_cache_dir``,
else ``$HF_HUB_CACHE``, else huggingface_hub's default ``~/.cache/huggingface/hub``), so
models already cached by ``mlx_lm`` or ``hf download`` are reused. ``revision``: a branch,
tag or commit hash (default ``main``); the assignment's ``source.revision`` is a label and is
not used. The Mac's token (``HF_TOKEN`` or huggingface_hub's stored login) is sent only when
``use_token`` (the source policy's ``hfTokenOrganizations``); otherwise the request is
anonymous (``token=False``), so nobody who may create a ModelDeployment reads the Mac's
private or gated repositories. Offline mode (``HF_HUB_OFFLINE=1`` at call time, or ``offline=True``) reads the
cache only (``local_files_only``). Only the files mlx-lm loads are fetched
(:data:`HUB_ALLOW_PATTERNS`; no ``*.py``). Timeouts, retries and resumption are
huggingface_hub's; progress comes from its progress bars (best effort). Before the first byte
(online), a dry run of ``snapshot_download`` (``dry_run=True``: the files it would fetch, with
their sizes) gives the bytes still to fetch (:func:`~node_agent.fetch.bounds.hub_need`),
checked against the Hugging Face cache's disk minus the reserve and — when the Hugging Face
cache is the agent's own (``model_cache/hf``, :func:`~node_agent.fetch.cache.hub_cache_dir`)
— against the model cache's cap, which then counts it too
(:func:`~node_agent.fetch.bounds.room_refusal`; ``make_room`` first, then
``InsufficientDisk``). It fails closed: a file to fetch without a size is ``InvalidSource``;
a dry run that fails (the hub unreachable or not listing the files) is ``DownloadFailed``
with nothing fetched — unless the revision is already in the cache, which is then used as
it is (``local_files_only``: nothing is downloaded). The commit to fetch (pinned, or the one
a branch resolved to) must be on a branch or tag of the repository — a branch's or tag's
head, or in its history (``HfApi.list_repo_refs``, then ``list_repo_commits`` per branch and
tag) — else ``SourceRefused``: the Hub serves any commit of a public repository by its hash,
a pull request's (``refs/pr/N``) too, which the organisation named in the URI did not
necessarily write. The download then fetches the commit the dry run checked, not the branch
or tag again (it may have moved meanwhile), and records ``refs/<branch or tag>`` as
huggingface_hub would.

:func:`_fetch_hub` returns the checked ``snapshots/<commit>/`` directory. It raises
:class:`~node_agent.model_dir.SourceError`: ``ModelNotFound`` (no such repository or
revision, a gated one without access, not cached while offline), ``DownloadFailed`` (the Hub
unreachable, an HTTP error, an OS error), ``InvalidSource`` (a malformed URI, a bad model
directory, a file the hub gives no size for), ``SourceRefused`` (a commit on no branch or
tag), ``InsufficientDisk`` (the files to fetch don't fit above the disk's reserve or the
cap).
Cancelling the awaiting task leaves the download running in its thread until huggingface_hub
finishes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_fleet.source_policy import REFUSED

from ..model_dir import SOURCE_REFUSED, SourceError, check_model_dir
from .bounds import DownloadLimits, hub_need, is_commit
from .cache import MakeRoom, ensure_room
from .manifest import parse_hf_uri
from .progress import ProgressCallback, _Progress

log = logging.getLogger("node_agent.fetch")

#: Files of a hub repository that are fetched (what mlx-lm loads; never ``*.py``).
HUB_ALLOW_PATTERNS = ("*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken",
                      "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    if _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_bar_class(bars: list[Any]) -> type:
    """A tqdm class that records huggingface_hub's progress bars (n, total, unit) and renders
    nothing."""
    from tqdm.auto import tqdm

    class _Bar(tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("name", None)
            kwargs["disable"] = False
            kwargs["file"] = _NullWriter()
            kwargs["mininterval"] = 3600.0
            super().__init__(*args, **kwargs)
            bars.append(self)

    return _Bar


class _NullWriter:
    """A text sink for the recording progress bars."""

    def write(self, _: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _hub_numbers(bars: list[Any]) -> tuple[int, int, int, int] | None:
    """``(bytes_done, bytes_total, files_done, files_total)`` from recorded bars."""
    byte_bars = [b for b in list(bars) if getattr(b, "unit", "") == "B"]
    file_bars = [b for b in list(bars) if getattr(b, "unit", "") != "B"]
    if not byte_bars and not file_bars:
        return None
    done = total = files_done = files_total = 0
    if byte_bars:
        bar = max(byte_bars, key=lambda b: (b.total or 0, b.n or 0))
        done, total = int(bar.n or 0), int(bar.total or 0)
    if file_bars:
        bar = max(file_bars, key=lambda b: b.total or 0)
        files_done, files_total = int(bar.n or 0), int(bar.total or 0)
    return done, total, files_done, files_total


def _tree_numbers(snapshot: Path) -> tuple[int, int]:
    """``(bytes, files)`` of the files in a snapshot directory (symlinks followed)."""
    size = count = 0
    for dirpath, _, filenames in os.walk(snapshot):
        for name in filenames:
            with contextlib.suppress(OSError):
                size += os.stat(os.path.join(dirpath, name)).st_size
                count += 1
    return size, count


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (for ``disk_usage`` of a cache not made yet)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _record_ref(repo_folder: Path, revision: str, commit: str) -> None:
    """Write ``repo_folder/refs/<revision>`` holding ``commit`` (huggingface_hub's cache
    layout: the commit a branch or tag resolved to, read offline), atomically. Errors are
    logged: the download itself is complete."""
    ref = repo_folder / "refs" / revision
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(ref.name + ".tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError as e:
        log.warning("cannot record %s → %s in the Hugging Face cache: %s", revision, commit, e)


async def _check_hub_room(download: Callable[..., Any], reachable: Callable[[str], bool], *,
                          cache: str | None, what: str,
                          limits: DownloadLimits, disk_usage: Callable[[str], Any],
                          make_room: MakeRoom | None,
                          model_cache: Path | None = None) -> tuple[Path | None, str | None]:
    """Whether the dry run's commit is ``reachable`` from a branch or tag (else
    ``SourceRefused``), then the dry run's bytes to fetch
    (:func:`~node_agent.fetch.bounds.hub_need`) against the
    Hugging Face cache's disk minus the reserve, and against the cap over ``model_cache``
    when given (the Hugging Face cache is the agent's own); ``make_room`` is asked once.
    Returns ``(None, the commit checked)`` (go on and download that commit), or ``(the cached
    snapshot to use as it is, None)`` when the dry run failed but the revision is in the
    cache. Raises ``InsufficientDisk``,
    ``InvalidSource`` (a file without a size), ``SourceRefused`` (a commit on no branch or tag),
    ``DownloadFailed`` (the dry run or the refs' listing failed and
    nothing is cached), or huggingface_hub's not-found errors (mapped by the caller)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (GatedRepoError, RepositoryNotFoundError,
                                       RevisionNotFoundError)

    try:
        infos = await asyncio.to_thread(download, dry_run=True)
        commit = next((i.commit_hash for i in infos), None)
        on_ref = True if commit is None else await asyncio.to_thread(reachable, commit)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - fail closed: no size, no download
        log.warning("%s: the hub did not list the files to fetch and their sizes, or the "
                    "repository's branches and tags (%s: %s)", what, type(e).__name__, e)
        try:
            return Path(await asyncio.to_thread(download, local_only=True)), None
        except Exception:  # noqa: BLE001 - not cached: refused below
            pass
        raise SourceError("DownloadFailed",
                          f"{what}: the hub did not list the files to fetch and their sizes "
                          "(or the repository's branches and tags), so the download can't be "
                          "checked; nothing was downloaded") from e
    if not on_ref:
        raise SourceError(SOURCE_REFUSED,
                          f"{REFUSED}: {what}: commit {commit} is on no branch or tag of the "
                          "repository (a pull request's commit, say), so the organisation may "
                          "not have written it")
    need = hub_need(((i.filename, i.file_size, i.will_download) for i in infos), what=what)
    await ensure_room(need, where=_existing(Path(cache or constants.HF_HUB_CACHE)),
                      limits=limits, disk_usage=disk_usage, make_room=make_room, what=what,
                      model_cache=model_cache)
    return None, commit


async def _fetch_hub(uri: str, *, callback: ProgressCallback, interval: float,
                     stall_timeout_s: float, cache_dir: str | os.PathLike | None,
                     endpoint: str | None, offline: bool | None,
                     limits: DownloadLimits | None = None,
                     disk_usage: Callable[[str], Any] = shutil.disk_usage,
                     make_room: MakeRoom | None = None,
                     use_token: bool = False, model_cache: Path | None = None) -> Path:
    """Fetch ``uri`` (module docstring); ``model_cache``: given when ``cache_dir`` is the
    agent's own Hugging Face cache, whose bytes count under ``limits``' cap."""
    repo_id, revision = parse_hf_uri(uri)
    is_offline = _hub_offline(offline)
    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    shown = f"{repo_id}@{revision or 'main'}"
    bars: list[Any] = []
    tracker = _Progress(callback, interval)

    def download(dry_run: bool = False, local_only: bool = False,
                 commit: str | None = None) -> Any:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=commit or revision, cache_dir=cache,
                                 local_files_only=is_offline or local_only,
                                 etag_timeout=stall_timeout_s,
                                 endpoint=endpoint, token=None if use_token else False,
                                 allow_patterns=list(HUB_ALLOW_PATTERNS),
                                 tqdm_class=_hub_bar_class([] if dry_run else bars),
                                 dry_run=dry_run)

    def reachable(commit: str) -> bool:
        """True when ``commit`` is a branch's or tag's, or in one's history (huggingface_hub's
        ``list_repo_refs``, then ``list_repo_commits`` of each branch and tag)."""
        from huggingface_hub import HfApi

        api = HfApi(endpoint=endpoint, token=None if use_token else False)
        refs = api.list_repo_refs(repo_id)
        heads = [*refs.branches, *refs.tags]
        if any(r.target_commit == commit for r in heads):
            return True
        return any(c.commit_id == commit for r in heads
                   for c in api.list_repo_commits(repo_id, revision=r.name))

    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    task: asyncio.Future | None = None
    try:
        cached = checked = None
        if not is_offline:  # offline, nothing is fetched
            cached, checked = await _check_hub_room(download, reachable, cache=cache,
                                                    what=f"hf://{shown}",
                                                    limits=limits or DownloadLimits(),
                                                    disk_usage=disk_usage, make_room=make_room,
                                                    model_cache=model_cache)
        # the commit checked, not the branch again: it may have moved since the dry run
        task = asyncio.ensure_future(asyncio.sleep(0, cached) if cached is not None
                                     else asyncio.to_thread(download, commit=checked))
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                break
            numbers = _hub_numbers(bars)
            if numbers is not None:
                tracker.override = numbers
                tracker.set_wire(numbers[0])
        folder = Path(task.result())
    except GatedRepoError as e:
        raise SourceError("ModelNotFound", f"{repo_id} is a gated repository: set HF_TOKEN to a "
                                           f"token that was granted access ({e})") from e
    except RepositoryNotFoundError as e:
        raise SourceError("ModelNotFound", f"no repository {repo_id} on the Hugging Face Hub "
                                           "(or it is private and HF_TOKEN has no access)") from e
    except RevisionNotFoundError as e:
        raise SourceError("ModelNotFound", f"{repo_id} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        if is_offline:
            raise SourceError("ModelNotFound",
                              f"{shown} is not (completely) in the local Hugging Face cache "
                              f"{cache or '(default)'}, and offline mode (HF_HUB_OFFLINE) forbids "
                              "downloading it") from e
        raise SourceError("DownloadFailed", f"{shown}: the Hub could not be reached and the "
                                            f"model is not cached: {e}") from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise SourceError("DownloadFailed", f"{shown}: {e}",
                          http_status=status if isinstance(status, int) else None) from e
    except ValueError as e:
        raise SourceError("InvalidSource", f"{uri}: {e}") from e
    except OSError as e:
        raise SourceError("DownloadFailed", f"{shown}: {type(e).__name__}: {e}") from e
    finally:
        if task is not None and not task.done():
            task.cancel()  # the thread finishes on its own; huggingface_hub locks its blobs
    if checked is not None and cached is None and not is_commit(revision):
        # as huggingface_hub records a branch or tag it resolved: refs/<revision> → commit
        await asyncio.to_thread(_record_ref, folder.parent.parent, revision or "main", checked)
    # snapshots/<commit>/ links into the repository folder's blobs/
    await asyncio.to_thread(check_model_dir, folder, root=folder.parent.parent)
    with contextlib.suppress(OSError):  # its last use, for the garbage collector
        os.utime(folder)
    size, count = await asyncio.to_thread(_tree_numbers, folder)
    tracker.override = (size, size, count, count)
    tracker.maybe_emit(force=True)
    return folder
