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
their sizes) gives the bytes still to fetch, checked against the Hugging Face cache's disk
minus the reserve (:func:`~node_agent.fetch.bounds.room_refusal`; ``make_room`` first, then
``InsufficientDisk``); the model cache's cap does not apply to the Hugging Face cache.

:func:`_fetch_hub` returns the checked ``snapshots/<commit>/`` directory. It raises
:class:`~node_agent.model_dir.SourceError`: ``ModelNotFound`` (no such repository or
revision, a gated one without access, not cached while offline), ``DownloadFailed`` (the Hub
unreachable, an HTTP error, an OS error), ``InvalidSource`` (a malformed URI or a bad model
directory), ``InsufficientDisk`` (the files to fetch don't fit above the disk's reserve).
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

from ..model_dir import SourceError, check_model_dir
from .bounds import DownloadLimits
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


async def _check_hub_room(download: Callable[..., Any], *, cache: str | None, what: str,
                          limits: DownloadLimits, disk_usage: Callable[[str], Any],
                          make_room: MakeRoom | None) -> None:
    """The dry run's bytes to fetch against the Hugging Face cache's disk minus the reserve;
    ``make_room`` is asked once. Raises ``InsufficientDisk``."""
    from huggingface_hub import constants

    try:
        infos = await asyncio.to_thread(download, dry_run=True)
    except Exception as e:  # noqa: BLE001 - the download itself reports (or falls back)
        log.warning("%s: could not list the files to fetch (%s: %s); the download is not "
                    "checked against the disk's reserve", what, type(e).__name__, e)
        return
    need = sum(i.file_size or 0 for i in infos if i.will_download)
    await ensure_room(need, where=_existing(Path(cache or constants.HF_HUB_CACHE)),
                      limits=limits, disk_usage=disk_usage, make_room=make_room, what=what)


async def _fetch_hub(uri: str, *, callback: ProgressCallback, interval: float,
                     stall_timeout_s: float, cache_dir: str | os.PathLike | None,
                     endpoint: str | None, offline: bool | None,
                     limits: DownloadLimits | None = None,
                     disk_usage: Callable[[str], Any] = shutil.disk_usage,
                     make_room: MakeRoom | None = None,
                     use_token: bool = False) -> Path:
    repo_id, revision = parse_hf_uri(uri)
    is_offline = _hub_offline(offline)
    cache = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    shown = f"{repo_id}@{revision or 'main'}"
    bars: list[Any] = []
    tracker = _Progress(callback, interval)

    def download(dry_run: bool = False) -> Any:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                 local_files_only=is_offline, etag_timeout=stall_timeout_s,
                                 endpoint=endpoint, token=None if use_token else False,
                                 allow_patterns=list(HUB_ALLOW_PATTERNS),
                                 tqdm_class=_hub_bar_class([] if dry_run else bars),
                                 dry_run=dry_run)

    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    task: asyncio.Future | None = None
    try:
        if not is_offline:  # offline, nothing is fetched
            await _check_hub_room(download, cache=cache, what=f"hf://{shown}",
                                  limits=limits or DownloadLimits(), disk_usage=disk_usage,
                                  make_room=make_room)
        task = asyncio.ensure_future(asyncio.to_thread(download))
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
    # snapshots/<commit>/ links into the repository folder's blobs/
    await asyncio.to_thread(check_model_dir, folder, root=folder.parent.parent)
    size, count = await asyncio.to_thread(_tree_numbers, folder)
    tracker.override = (size, size, count, count)
    tracker.maybe_emit(force=True)
    return folder
