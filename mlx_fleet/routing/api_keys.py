"""Bearer API keys of the fleet's HTTP APIs (the agent's, the fleet router's): the key file, the
constant-time match, the reload.

The pure parts (plain functions over plain data, tested table-driven in
``tests/test_api_keys.py``):

* :func:`parse_key_file` — a key file's text → the keys: one key per line, surrounding
  whitespace ignored, blank lines and lines starting with ``#`` skipped. A key is 16 to 512
  printable ASCII characters without spaces (OpenAI's ``sk-...`` keys and ``openssl rand -hex
  32`` both qualify); a bad line raises :class:`KeyFileError` naming its line number, never its
  content. A key may be followed, after whitespace, by ``tenant=<name>``: the tenant the key
  belongs to (the fleet router's per-tenant limits and metric label; the agent ignores it). The
  name is a DNS label (RFC 1123: 1 to 63 lower-case letters, digits and ``-``, starting and
  ending with a letter or digit), so a metric label's values stay bounded by the file; a key
  without one belongs to :data:`DEFAULT_TENANT`. :func:`parse_key_entries` gives both.
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
import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["KeyFileError", "Stamp", "parse_key_file", "parse_key_entries", "bearer_token",
           "digest", "matches", "match_index", "stamp_changed", "KeyFile", "MIN_KEY_LENGTH",
           "MAX_KEY_LENGTH", "DEFAULT_TENANT"]

log = logging.getLogger(__name__)

#: Shortest key accepted (characters): 16 random hex characters are 64 bits.
MIN_KEY_LENGTH = 16
#: Longest key accepted (characters); bounds the work per request.
MAX_KEY_LENGTH = 512
#: The tenant of a key whose line names none.
DEFAULT_TENANT = "default"
_TENANT_FIELD = "tenant="
_TENANT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


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


def parse_key_entries(text: str) -> tuple[tuple[str, str], ...]:
    """The ``(key, tenant)`` entries of a key file's ``text``, in file order, a key's first
    entry kept when it repeats. ``tenant``: the line's ``tenant=<name>``, else
    :data:`DEFAULT_TENANT`.

    Raises :class:`KeyFileError` for a line that is not a valid key (its number, not its
    content, is in the message), a bad tenant name, and a file without any key."""
    entries: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant = DEFAULT_TENANT
        fields = line.split()
        if len(fields) == 2 and fields[1].startswith(_TENANT_FIELD):
            name = fields[1][len(_TENANT_FIELD):]
            if not _TENANT_NAME.fullmatch(name):
                raise KeyFileError(f"line {n}: a tenant name is a DNS label (1 to 63 "
                                   f"characters a-z, 0-9 and '-', starting and ending with a "
                                   f"letter or digit)")
            line, tenant = fields[0], name
        if not (line.isascii() and line.isprintable()) or " " in line or "\t" in line:
            raise KeyFileError(f"line {n}: a key is printable ASCII without spaces")
        if not MIN_KEY_LENGTH <= len(line) <= MAX_KEY_LENGTH:
            raise KeyFileError(f"line {n}: a key has {MIN_KEY_LENGTH} to {MAX_KEY_LENGTH} "
                               f"characters, this one has {len(line)}")
        entries.setdefault(line, tenant)
    if not entries:
        raise KeyFileError("no key in the file (one key per line; '#' starts a comment)")
    return tuple(entries.items())


def parse_key_file(text: str) -> tuple[str, ...]:
    """The keys in a key file's ``text``, in file order, duplicates dropped (the keys of
    :func:`parse_key_entries`, which raises :class:`KeyFileError`)."""
    return tuple(key for key, _ in parse_key_entries(text))


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


def match_index(presented: str | None, digests: Iterable[bytes]) -> int | None:
    """The position in ``digests`` of the :func:`digest` of ``presented``, None when it is not
    there (or nothing was presented).

    Every digest is compared (:func:`hmac.compare_digest`), also after a match: the time
    taken depends on the number of keys only."""
    if presented is None:
        return None
    mine = digest(presented)
    found: int | None = None
    for i, d in enumerate(digests):
        if hmac.compare_digest(mine, d) and found is None:
            found = i
    return found


def matches(presented: str | None, digests: Iterable[bytes]) -> bool:
    """True when ``presented`` is one of the keys whose :func:`digest` is in ``digests``
    (:func:`match_index`, constant-time)."""
    return match_index(presented, digests) is not None


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
        self._tenants: tuple[str, ...] = ()
        self._digests: tuple[bytes, ...] = ()
        self._failing = False
        stamp, keys = self._read()
        self._install(stamp, keys)

    def __repr__(self) -> str:  # never the keys
        return f"KeyFile({str(self.path)!r}, {len(self._keys)} keys)"

    def _read(self) -> tuple[Stamp, tuple[tuple[str, str], ...]]:
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
            return stamp, parse_key_entries(text)
        except KeyFileError as e:
            raise KeyFileError(f"{self.flag} {str(self.path)!r}: {e}") from None

    def _install(self, stamp: Stamp, entries: tuple[tuple[str, str], ...]) -> None:
        self._stamp = stamp
        self._keys = tuple(k for k, _ in entries)
        self._tenants = tuple(t for _, t in entries)
        self._digests = tuple(digest(k) for k in self._keys)

    @property
    def first(self) -> str:
        """The first key of the last good read."""
        return self._keys[0]

    def __len__(self) -> int:
        return len(self._keys)

    def tenant_of(self, presented: str | None) -> str | None:
        """The tenant of the presented key (its line's ``tenant=``, else
        :data:`DEFAULT_TENANT`), None when it is not a key in force. Reads :meth:`current`
        first (a rotated file is in force at once); constant-time like :func:`matches`."""
        i = match_index(presented, self.current())
        return None if i is None else self._tenants[i]

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
