"""Bearer API keys of the fleet's HTTP APIs (the agent's, the fleet router's): the key file, the
constant-time match, the reload.

The pure parts (plain functions over plain data, tested table-driven in
``tests/test_api_keys.py``):

* :func:`parse_key_file` — a key file's text → the keys: one key per line, surrounding
  whitespace ignored, blank lines and lines starting with ``#`` skipped. A key is 16 to 512
  printable ASCII characters without spaces (OpenAI's ``sk-...`` keys and ``openssl rand -hex
  32`` both qualify); a bad line raises :class:`KeyFileError` naming its line number, never its
  content.
* :func:`bearer_token` — an ``Authorization`` header value → the presented key, or None.
* :func:`matches` — does a presented key equal one of the keys? Both sides are hashed with
  SHA-256 first and every key is compared with :func:`hmac.compare_digest`, without stopping at
  the first match, so neither the position of the matching key nor the keys' lengths show in
  the time taken.
* :func:`stamp_changed` — the reload policy: the file is re-read when its ``(st_ino,
  st_size, st_mtime_ns, st_ctime_ns)`` differs from the last read's. An atomic replace (write a
  new file, rename over the old: a new inode) and an in-place rewrite (new mtime/ctime) are both
  seen.

:class:`KeyFile` is the thin I/O around them. It checks the file with one ``os.stat`` on every
request (:meth:`KeyFile.current`; ~15 µs measured on a busy 2-core Linux box, nothing against a
generation), so a
rotated file is in force from the very next request, with no restart and no polling task. A
file that becomes unreadable or invalid keeps the last good keys in force and logs one ERROR
(naming the path and the reason, never a key) until it is good again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["KeyFileError", "Stamp", "parse_key_file", "bearer_token", "digest", "matches",
           "stamp_changed", "KeyFile", "MIN_KEY_LENGTH", "MAX_KEY_LENGTH"]

log = logging.getLogger(__name__)

#: Shortest key accepted (characters): 16 random hex characters are 64 bits.
MIN_KEY_LENGTH = 16
#: Longest key accepted (characters); bounds the work per request.
MAX_KEY_LENGTH = 512


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the path or line, never a key."""


@dataclasses.dataclass(frozen=True)
class Stamp:
    """What ``os.stat`` says about a key file, enough to notice that it changed."""

    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "Stamp":
        return cls(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def parse_key_file(text: str) -> tuple[str, ...]:
    """The keys in a key file's ``text``, in file order, duplicates dropped.

    Raises :class:`KeyFileError` for a line that is not a valid key (its number, not its
    content, is in the message) and for a file without any key."""
    keys: dict[str, None] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not (line.isascii() and line.isprintable()) or " " in line or "\t" in line:
            raise KeyFileError(f"line {n}: a key is printable ASCII without spaces")
        if not MIN_KEY_LENGTH <= len(line) <= MAX_KEY_LENGTH:
            raise KeyFileError(f"line {n}: a key has {MIN_KEY_LENGTH} to {MAX_KEY_LENGTH} "
                               f"characters, this one has {len(line)}")
        keys[line] = None
    if not keys:
        raise KeyFileError("no key in the file (one key per line; '#' starts a comment)")
    return tuple(keys)


def bearer_token(authorization: str | None) -> str | None:
    """``"Bearer <key>"`` (scheme case-insensitive, RFC 6750) → ``<key>``; None for a missing
    header, another scheme or an empty key."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def digest(key: str) -> bytes:
    """SHA-256 of ``key`` (UTF-8; undecodable characters replaced): what :func:`matches`
    compares, so every comparison is over 32 bytes whatever the key's length."""
    return hashlib.sha256(key.encode("utf-8", "replace")).digest()


def matches(presented: str | None, digests: Iterable[bytes]) -> bool:
    """True when ``presented`` is one of the keys whose :func:`digest` is in ``digests``.

    Every digest is compared (:func:`hmac.compare_digest`), also after a match: the time
    taken depends on the number of keys only."""
    if presented is None:
        return False
    mine = digest(presented)
    found = False
    for d in digests:
        found |= hmac.compare_digest(mine, d)
    return found


def stamp_changed(last: Stamp | None, now: Stamp) -> bool:
    """Re-read the file? Yes when it was never read or any field of its stamp differs."""
    return last != now


class KeyFile:
    """The keys of one key file, re-read when it changes (see the module docstring).

    ``flag`` names the command-line flag in messages (``--api-key-file``). Construction reads
    the file and raises :class:`KeyFileError` if it cannot be used (the agent refuses to
    start). :meth:`current` returns the digests in force; :attr:`first` is the file's first key
    (what a forwarding agent presents)."""

    def __init__(self, path: str | Path, *, flag: str = "--api-key-file") -> None:
        self.path = Path(path)
        self.flag = flag
        self._stamp: Stamp | None = None
        self._keys: tuple[str, ...] = ()
        self._digests: tuple[bytes, ...] = ()
        self._failing = False
        stamp, keys = self._read()
        self._install(stamp, keys)

    def __repr__(self) -> str:  # never the keys
        return f"KeyFile({str(self.path)!r}, {len(self._keys)} keys)"

    def _read(self) -> tuple[Stamp, tuple[str, ...]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                stamp = Stamp.of(os.fstat(f.fileno()))
                text = f.read()
        except UnicodeDecodeError:
            raise KeyFileError(f"{self.flag} {str(self.path)!r}: not UTF-8 text") from None
        except OSError as e:
            raise KeyFileError(f"{self.flag} {str(self.path)!r}: cannot read "
                               f"({e.strerror or type(e).__name__})") from None
        try:
            return stamp, parse_key_file(text)
        except KeyFileError as e:
            raise KeyFileError(f"{self.flag} {str(self.path)!r}: {e}") from None

    def _install(self, stamp: Stamp, keys: tuple[str, ...]) -> None:
        self._stamp, self._keys = stamp, keys
        self._digests = tuple(digest(k) for k in keys)

    @property
    def first(self) -> str:
        """The first key of the last good read."""
        return self._keys[0]

    def __len__(self) -> int:
        return len(self._keys)

    def current(self) -> tuple[bytes, ...]:
        """The key digests in force: one ``os.stat``, and a re-read if the file changed. A
        failed stat or re-read keeps the previous keys (one ERROR log until it recovers)."""
        try:
            changed = stamp_changed(self._stamp, Stamp.of(os.stat(self.path)))
            if changed:
                stamp, keys = self._read()
        except (OSError, KeyFileError) as e:
            if not self._failing:
                self._failing = True
                reason = e if isinstance(e, KeyFileError) else \
                    f"{self.flag} {str(self.path)!r}: cannot read ({e.strerror})"
                log.error("%s; keeping the %d key(s) read before", reason, len(self._keys))
            return self._digests
        if changed:
            before = len(self._keys)
            self._install(stamp, keys)
            log.info("%s %s re-read: %d key(s) in force (%d before)", self.flag, self.path,
                     len(keys), before)
        if self._failing:
            self._failing = False
            if not changed:
                log.info("%s %s is readable again", self.flag, self.path)
        return self._digests
