"""How mlx-fleet authenticates to etcd: TLS files, a user name and a password, read once.

One :class:`EtcdCredentials` is built by :func:`load_credentials` from the flags that
:func:`add_etcd_arguments` defines (the agent, the operator and ``mlx-fleet etcd`` share them)
and handed to :class:`mlx_fleet.store.EtcdStore`. The password never travels as a flag value
(it would show in ``ps``): it is read from ``--etcd-password-file`` or from the environment
variable ``MLX_FLEET_ETCD_PASSWORD``. Secrets are kept out of ``repr`` so a logged config or
a traceback does not print them.

Two ways to be an etcd user (docs/security.md):

* **client certificate** (recommended): etcd started with ``--client-cert-auth`` maps the
  certificate's Common Name to the etcd user of that name; no password and no token, so
  nothing expires (etcd's simple tokens live ``--auth-token-ttl``, default 300 s).
* **user name + password**: the store authenticates, sends the token with each call and
  re-authenticates once when etcd answers that the token is invalid or expired.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

PASSWORD_ENV = "MLX_FLEET_ETCD_PASSWORD"
"""Environment variable read for the etcd password when no ``--etcd-password-file`` is given."""


class CredentialsError(ValueError):
    """A TLS or auth setting is missing, unreadable or inconsistent (one line, names the flag)."""


@dataclasses.dataclass(frozen=True)
class EtcdCredentials:
    """What a client presents to etcd. All fields optional; an empty one means plain HTTP and
    no auth.

    ``ca_pem``: PEM bundle of the CA(s) that signed etcd's server certificate;
    ``cert_pem`` / ``key_pem``: the client certificate chain and its private key (PEM), both
    or neither; ``username`` / ``password``: etcd simple auth, both or neither.
    """

    ca_pem: bytes | None = dataclasses.field(default=None, repr=False)
    cert_pem: bytes | None = dataclasses.field(default=None, repr=False)
    key_pem: bytes | None = dataclasses.field(default=None, repr=False)
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert_pem is None) != (self.key_pem is None):
            raise CredentialsError("--etcd-cert-file and --etcd-key-file must be given together")
        if (self.username is None) != (self.password is None):
            raise CredentialsError("--etcd-username needs a password (--etcd-password-file or "
                                   f"${PASSWORD_ENV}), and a password needs --etcd-username")

    @property
    def tls(self) -> bool:
        """True if the connection must use TLS (a CA or a client certificate was given)."""
        return self.ca_pem is not None or self.cert_pem is not None


def _read(path: str | os.PathLike | None, flag: str) -> bytes | None:
    if path is None or path == "":
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise CredentialsError(f"{flag} {str(path)!r}: cannot read ({e.strerror or e})") from None
    if not data.strip():
        raise CredentialsError(f"{flag} {str(path)!r}: file is empty")
    return data


def _pem(path: str | os.PathLike | None, flag: str, marker: bytes) -> bytes | None:
    data = _read(path, flag)
    if data is not None and (b"-----BEGIN " not in data or marker not in data):
        raise CredentialsError(f"{flag} {str(path)!r}: not a PEM {marker.decode().lower()} file")
    return data


def load_credentials(*, ca_file: str | os.PathLike | None = None,
                     cert_file: str | os.PathLike | None = None,
                     key_file: str | os.PathLike | None = None,
                     username: str | None = None,
                     password_file: str | os.PathLike | None = None,
                     environ: Mapping[str, str] | None = None) -> EtcdCredentials:
    """Read the files named by the flags into :class:`EtcdCredentials`.

    The password comes from ``password_file`` (trailing newline stripped) or else from
    ``environ[PASSWORD_ENV]`` (``os.environ`` by default), and only if ``username`` is set.
    Raises :class:`CredentialsError` with one line naming the flag and the path for a missing,
    unreadable, empty or non-PEM file, or an inconsistent combination (cert without key, user
    without password). The message never contains the files' contents.
    """
    env = os.environ if environ is None else environ
    password: str | None = None
    if password_file:
        raw = _read(password_file, "--etcd-password-file")
        password = raw.decode("utf-8", "replace").rstrip("\r\n") if raw is not None else None
    elif username and env.get(PASSWORD_ENV):
        password = env[PASSWORD_ENV]
    if password_file and not username:
        raise CredentialsError("--etcd-password-file needs --etcd-username")
    return EtcdCredentials(
        ca_pem=_pem(ca_file, "--etcd-ca-file", b"CERTIFICATE"),
        cert_pem=_pem(cert_file, "--etcd-cert-file", b"CERTIFICATE"),
        key_pem=_pem(key_file, "--etcd-key-file", b"PRIVATE KEY"),
        username=username or None, password=password)


def add_etcd_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--etcd-*`` TLS/auth flags (defaults from ``MLX_FLEET_ETCD_*`` env vars)."""
    g = parser.add_argument_group("etcd TLS and authentication (docs/security.md)")
    g.add_argument("--etcd-ca-file", default=os.environ.get("MLX_FLEET_ETCD_CA_FILE"),
                   help="PEM CA bundle that signed etcd's server certificate; needed for an "
                        "https:// endpoint (env MLX_FLEET_ETCD_CA_FILE)")
    g.add_argument("--etcd-cert-file", default=os.environ.get("MLX_FLEET_ETCD_CERT_FILE"),
                   help="PEM client certificate for mutual TLS; with etcd's --client-cert-auth "
                        "its Common Name is the etcd user (env MLX_FLEET_ETCD_CERT_FILE)")
    g.add_argument("--etcd-key-file", default=os.environ.get("MLX_FLEET_ETCD_KEY_FILE"),
                   help="PEM private key of --etcd-cert-file (env MLX_FLEET_ETCD_KEY_FILE)")
    g.add_argument("--etcd-username", default=os.environ.get("MLX_FLEET_ETCD_USERNAME"),
                   help="etcd user for password auth (env MLX_FLEET_ETCD_USERNAME); not needed "
                        "with a client certificate")
    g.add_argument("--etcd-password-file", default=os.environ.get("MLX_FLEET_ETCD_PASSWORD_FILE"),
                   help=f"file holding the etcd password (env MLX_FLEET_ETCD_PASSWORD_FILE, or "
                        f"the password itself in ${PASSWORD_ENV}); never a flag value")


def credentials_from_args(args: argparse.Namespace) -> EtcdCredentials:
    """:func:`load_credentials` over the flags of :func:`add_etcd_arguments`."""
    return load_credentials(ca_file=args.etcd_ca_file, cert_file=args.etcd_cert_file,
                            key_file=args.etcd_key_file, username=args.etcd_username,
                            password_file=args.etcd_password_file)
