"""A local model directory: the checks it passes before anything is loaded from it, and the
error every model source raises (:class:`SourceError`).

Both :mod:`node_agent.sources` (local directories, and the front door for every source) and
:mod:`node_agent.fetch` (downloads, whose result is checked the same way) use this module, which
imports neither of them.

A directory must hold a ``config.json`` that is a JSON object of at most
:data:`MAX_CONFIG_BYTES` and asks for no custom model code (``trust_remote_code`` is never
enabled, and is passed as ``False`` wherever a tokenizer or model is loaded): no ``model_file``
and no ``auto_map`` in ``config.json`` or ``tokenizer_config.json``, and no Python file
(``*.py``) anywhere in the directory. No entry in it may be a symlink that leads out of the
model's root, nor a device, FIFO or socket (:func:`check_model_dir`). The directory is looked
at only when it has a ``config.json`` entry, and at most :data:`MAX_MODEL_DIR_ENTRIES` entries
are walked (``file:///usr`` is refused at once, not after a walk of its whole tree).

What a failure says in a status (:func:`status_message`) is not what it says in the agent's
log: the log has the detail (addresses, TLS errors, paths, symlink targets), a status only
the kind of failure, so a resource's status is no probe of the Macs' network or disks.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from mlx_fleet.source_policy import SOURCE_REFUSED

__all__ = ["SourceError", "check_model_dir", "check_config", "status_message",
           "MAX_CONFIG_BYTES", "MAX_MODEL_DIR_ENTRIES", "CODE_SUFFIXES", "CODE_KEYS"]

#: Largest ``config.json`` read (bytes); a bigger one is refused as ``InvalidSource``.
MAX_CONFIG_BYTES = 16 * 2**20
#: Most entries (files, directories, links) a model directory may hold; a bigger tree is
#: refused as ``InvalidSource`` without walking on (a Hugging Face snapshot holds tens).
MAX_MODEL_DIR_ENTRIES = 10_000
#: File suffixes refused in a model directory: code transformers would import with
#: ``trust_remote_code`` (``modeling_*.py``, ``tokenization_*.py``, …).
CODE_SUFFIXES = (".py", ".pyc")
#: ``config.json`` / ``tokenizer_config.json`` keys that name custom code: ``auto_map``
#: (transformers' remote-code classes), ``model_file`` (mlx-lm's custom architecture).
CODE_KEYS = ("auto_map", "model_file")


class SourceError(Exception):
    """A model source can't be used. ``reason``: CamelCase machine reason; ``message``:
    human-readable detail.

    ``http_status``: the HTTP status that caused it, when one did (a status shows its class).
    ``public``: what a status may say instead of the generic text of its reason, set where the
    detail names only things inside the model (``config.json is not valid JSON``), never an
    absolute path, a symlink's target or a network detail (:func:`status_message`).

    Reasons: ``SourceRefused`` (the fleet's source policy refuses the source, an address it
    resolves to, a redirect or a resolved path), ``ModelNotFound`` (no such directory,
    repository, revision or mirror),
    ``UnsupportedSource`` (unknown scheme, ``http://``), ``InvalidSource`` (malformed URI,
    unsafe path or symlink, bad ``config.json`` or manifest), ``DownloadFailed`` (HTTP error,
    connection lost too often, hub unreachable), ``DownloadStalled`` (no bytes for the stall
    timeout), ``DownloadCorrupt`` (size or sha256 mismatch)."""

    def __init__(self, reason: str, message: str, *, http_status: int | None = None,
                 public: str | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.http_status = http_status
        self.public = public


def status_message(err: SourceError, uri: str) -> str:
    """What a report (and so a resource's status and events) says about ``err`` for the
    source ``uri``: the kind of failure without network or file-system detail (no address,
    TLS or certificate error, path, symlink target or server text). A policy refusal and an
    unsupported scheme say the rule (they judge the URI, which the resource's author wrote);
    an HTTP failure its status class; a model directory refused by its checks what is wrong
    inside it (``err.public``). The detail is in the agent's log."""
    scheme = (uri or "").strip().partition("://")[0].lower() if "://" in (uri or "") else "file"
    status = f" (HTTP {err.http_status // 100}xx)" if err.http_status else ""
    if err.reason in (SOURCE_REFUSED, "UnsupportedSource"):
        return err.message
    if err.public is not None:
        return err.public
    if err.reason == "DownloadStalled":
        return ("download stalled (no data within the stall timeout); partial files are kept "
                "and the download resumes on the next attempt")
    if err.reason == "DownloadCorrupt":
        return ("download failed verification (a size or sha256 differs from the manifest); "
                "the bad file was deleted")
    if err.reason == "ModelNotFound":
        if scheme == "hf":
            return ("no such repository or revision on the Hugging Face Hub, no access to it, "
                    "or not cached while offline")
        if scheme == "https":
            return f"download failed{status}: no model mirror at the source"
        return "no usable model directory at the source"
    if err.reason == "InvalidSource":
        return ("the source is not a usable model (a malformed URI or manifest, or a model "
                "directory refused by the agent's checks); details in the agent's log")
    return f"download failed{status}; details in the agent's log"


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def check_config(model_dir: Path) -> dict[str, Any]:
    """Read ``model_dir/config.json`` and return it (a dict).

    Raises :class:`SourceError`: ``ModelNotFound`` if it is missing; ``InvalidSource`` if it is
    larger than :data:`MAX_CONFIG_BYTES`, not JSON, not a JSON object, or names custom model code
    (``model_file``: loading it would need ``trust_remote_code``, which is never enabled)."""
    config = model_dir / "config.json"
    if not config.is_file():
        raise SourceError("ModelNotFound",
                          f"{model_dir} holds no config.json (not an mlx-lm model)")
    try:
        if config.stat().st_size > MAX_CONFIG_BYTES:
            raise SourceError("InvalidSource", f"{config} is larger than {MAX_CONFIG_BYTES} bytes",
                              public=f"config.json is larger than {MAX_CONFIG_BYTES} bytes")
        data = json.loads(config.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError("InvalidSource", f"{config} is not valid JSON: {e}",
                          public="config.json is not valid JSON") from e
    if not isinstance(data, dict):
        what = f"config.json is not a JSON object (got {type(data).__name__})"
        raise SourceError("InvalidSource", f"{config}: {what}", public=what)
    _refuse_code_keys(config, data)
    tok = model_dir / "tokenizer_config.json"
    if tok.is_file() and tok.stat().st_size <= MAX_CONFIG_BYTES:
        try:
            tok_data = json.loads(tok.read_bytes())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            tok_data = None  # the tokenizer's own loader reports a broken file
        if isinstance(tok_data, dict):
            _refuse_code_keys(tok, tok_data)
    return data


def _refuse_code_keys(path: Path, data: dict[str, Any]) -> None:
    for key in CODE_KEYS:
        if data.get(key) is not None:
            what = (f"{path.name} asks for custom code ({key}); trust_remote_code is never "
                    "enabled, so the model can't be loaded")
            raise SourceError("InvalidSource", what, public=what)


def check_model_dir(model_dir: Path, *, root: Path | None = None) -> None:
    """Refuse a model directory that isn't safe to load, before anything is loaded from it.

    Refuses at once a directory without a ``config.json`` entry (``ModelNotFound``) and stops
    after :data:`MAX_MODEL_DIR_ENTRIES` entries (``InvalidSource``).
    ``root``: the tree every symlink must stay in (default: the model directory itself; for a
    Hugging Face cache snapshot the repository folder, whose ``blobs/`` the snapshot links to).
    Walks ``model_dir`` without following symlinks; each symlink must resolve inside ``root``
    (a link to a directory inside ``model_dir``), every entry must be a regular file, a
    directory or such a symlink, and none may be code (:data:`CODE_SUFFIXES`). Then
    :func:`check_config`.

    Raises :class:`SourceError` (``InvalidSource`` naming the entry and where it leads;
    ``ModelNotFound`` without a ``config.json``)."""
    real_dir = os.path.realpath(model_dir)
    real_root = os.path.realpath(root) if root is not None else real_dir
    if not _within(real_dir, real_root):
        raise SourceError("InvalidSource",
                          f"{model_dir} resolves to {real_dir}, outside {real_root}",
                          public="the model directory resolves outside its root")
    if not os.path.lexists(os.path.join(real_dir, "config.json")):  # before any walk
        raise SourceError("ModelNotFound",
                          f"{model_dir} holds no config.json (not an mlx-lm model)")
    seen = 0
    for dirpath, dirnames, filenames in os.walk(real_dir):
        seen += len(dirnames) + len(filenames)
        if seen > MAX_MODEL_DIR_ENTRIES:
            what = (f"the model directory holds more than {MAX_MODEL_DIR_ENTRIES} entries; "
                    "not a model directory")
            raise SourceError("InvalidSource", f"{model_dir}: {what}", public=what)
        for name in [*dirnames, *filenames]:
            entry = os.path.join(dirpath, name)
            rel = os.path.relpath(entry, real_dir)
            try:
                st = os.lstat(entry)
            except OSError as e:
                raise SourceError("InvalidSource",
                                  f"cannot inspect {rel} in {model_dir}: {e}",
                                  public=f"{rel} in the model directory can't be "
                                         "inspected") from e
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry)
                inside = _within(target, real_root)
                if inside and os.path.isdir(target) and not _within(target, real_dir):
                    inside = False  # a linked directory's contents would escape the walk
                if not inside:
                    raise SourceError(
                        "InvalidSource",
                        f"{rel} in {model_dir} is a symlink to {target}, outside the model "
                        f"root {real_root}; refusing to load it",
                        public=f"{rel} is a symlink leading out of the model directory")
                if not os.path.exists(target):
                    raise SourceError("InvalidSource",
                                      f"{rel} in {model_dir} is a dangling symlink",
                                      public=f"{rel} is a dangling symlink")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                raise SourceError("InvalidSource",
                                  f"{rel} in {model_dir} is not a regular file or directory",
                                  public=f"{rel} is not a regular file or directory")
            if name.endswith(CODE_SUFFIXES) and not stat.S_ISDIR(st.st_mode):
                what = (f"{rel} is Python code; a model directory may hold no code "
                        "(trust_remote_code is never enabled)")
                raise SourceError("InvalidSource", f"{rel} in {model_dir}: {what}",
                                  public=what)
    check_config(Path(model_dir))
