"""A model mirror's ``manifest.json``, written for a model directory: ``mlx-fleet
make-manifest DIR``.

An ``https://`` model source is a directory served over HTTPS with a :data:`MANIFEST_NAME`
listing every file with its size and sha256 (format and checks:
:mod:`node_agent.fetch.manifest`; the agent refuses an entry without either). This writes it:
every regular file under ``DIR`` (symlinks to files followed, as in a Hugging Face snapshot),
sorted by path, except the manifest itself, hidden files (``.*``, e.g. an agent's download
state) and ``*.part`` files. A directory holding Python code (``*.py``, ``*.pyc``) is refused:
the agents refuse to load it (no custom code).

Errors: :class:`ValueError` (no ``config.json``, code in the directory, a path the manifest
can't carry), :class:`OSError` (unreadable files, an unwritable ``DIR``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["MANIFEST_NAME", "build_manifest", "write_manifest", "add_arguments", "run",
           "hash_file"]

#: The mirror's file list, at the mirror's base URL next to the model files.
MANIFEST_NAME = "manifest.json"
_BLOCK = 1 << 20


def hash_file(path: Path) -> tuple[Any, int]:
    """``(sha256 hasher, bytes read)`` of the file at ``path``, read in 1 MiB blocks; the hasher
    can go on (the agent resumes a partial download's hash with it)."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            n += len(block)
    return h, n


def build_manifest(model_dir: Path) -> dict[str, Any]:
    """``{"files": [{"path", "size", "sha256"}, ...]}`` for ``model_dir`` (rules in the module
    docstring), sorted by path. Raises ``ValueError`` / ``OSError``."""
    files: list[dict[str, Any]] = []
    root = Path(model_dir)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if name.startswith(".") or name.endswith(".part") or rel == MANIFEST_NAME:
                continue
            if name.endswith((".py", ".pyc")):
                raise ValueError(f"{rel} is Python code: the agents refuse a model directory "
                                 "holding code")
            if "\\" in rel or ":" in rel.split("/")[0]:
                raise ValueError(f"{rel!r} can't be a manifest path")
            if not path.is_file():
                continue  # a device, a socket, a dangling link: not part of a model
            hasher, size = hash_file(path)
            digest = hasher.hexdigest()
            files.append({"path": rel, "size": size, "sha256": digest})
    if not any(f["path"] == "config.json" for f in files):
        raise ValueError(f"{root} holds no config.json (not an mlx-lm model)")
    files.sort(key=lambda f: f["path"])
    return {"files": files}


def write_manifest(model_dir: Path) -> Path:
    """Write ``model_dir/manifest.json`` (through a temporary file and a rename) and return
    its path. Raises ``ValueError`` / ``OSError``."""
    data = json.dumps(build_manifest(model_dir), indent=1).encode() + b"\n"
    target = Path(model_dir) / MANIFEST_NAME
    tmp = target.with_name(f".{MANIFEST_NAME}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``make-manifest`` arguments to ``parser``."""
    parser.description = (
        "Write DIR/manifest.json listing every file of the model directory DIR with its size "
        "and sha256, so that DIR served over HTTPS is an https:// model source (the agents "
        "refuse a manifest entry without them). Hidden files and *.part files are left out; a "
        "directory holding Python code is refused.")
    parser.add_argument("dir", metavar="DIR", help="the model directory (holding config.json)")


def run(args: argparse.Namespace) -> int:
    """Run the command for parsed ``args``; prints the manifest's path; returns the exit
    code (2 on an error, with one line on stderr)."""
    try:
        path = write_manifest(Path(args.dir))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(path)
    return 0
