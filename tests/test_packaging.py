"""Deployment artefacts that cannot run here, checked statically: the agent's and the fleet
router's launchd plists (well-formed with plistlib, and their arguments accepted by their own
parsers) and the
operator's Dockerfile (no Docker engine here: unbuilt; checked against the chart and the
package's entry points)."""

from __future__ import annotations

import plistlib
import re
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PLIST = REPO / "deploy" / "launchd" / "io.mlx-fleet.agent.plist"
ROUTER_PLIST = REPO / "deploy" / "launchd" / "io.mlx-fleet.router.plist"


def test_launchd_plist_is_well_formed_and_keeps_the_agent_running() -> None:
    with PLIST.open("rb") as f:
        job = plistlib.load(f)
    assert job["Label"] == "io.mlx-fleet.agent" == PLIST.stem
    assert job["RunAtLoad"] is True and job["KeepAlive"] is True
    assert job["ExitTimeOut"] >= 10  # time to revoke the lease and drain on SIGTERM
    assert job["StandardOutPath"] == job["StandardErrorPath"]
    assert job["StandardErrorPath"].startswith("/Library/Logs/")
    assert job["ProgramArguments"][0].endswith("/bin/mlx-fleet-agent")


def test_launchd_job_is_closed_by_default() -> None:
    """Issue 19 (finding 1): a dedicated user, not root; an https:// etcd with this Mac's own
    client certificate (and no password); keys, TLS and a CA to verify the other Macs."""
    with PLIST.open("rb") as f:
        job = plistlib.load(f)
    assert job.get("UserName") not in (None, "root", "")
    assert job.get("GroupName") not in (None, "wheel", "admin", "")
    assert job["Umask"] & 0o077 == 0o077  # keys and downloads unreadable to other users
    env = job["EnvironmentVariables"]
    assert env["MLX_FLEET_ETCD_ENDPOINT"].startswith("https://")
    for var in ("MLX_FLEET_ETCD_CA_FILE", "MLX_FLEET_ETCD_CERT_FILE", "MLX_FLEET_ETCD_KEY_FILE"):
        assert env[var].startswith("/")
    assert "MLX_FLEET_ETCD_PASSWORD" not in env  # a client certificate, no password in a file
    home = env["HOME"]
    assert home.startswith("/") and not home.startswith(("/var/root", "/Users/"))


def test_launchd_arguments_parse_with_the_agents_own_cli_and_raise_no_exposure() -> None:
    """The agent's own parser accepts the plist's arguments, and the agent's own exposure check
    (what makes it refuse to start, or warn) finds nothing: listening on every address is
    fine because keys and TLS are set."""
    from mlx_fleet.exposure import exposure_check
    from node_agent.cli import build_parser

    with PLIST.open("rb") as f:
        job = plistlib.load(f)
    args = build_parser().parse_args(job["ProgramArguments"][1:])  # SystemExit on a bad flag
    assert args.advertise_url == "https://studio-1.lan:8000"
    assert args.listen[0] == "0.0.0.0"
    assert args.api_key_file and args.forward_key_file and args.metrics_auth == "api-key"
    assert args.tls_cert_file and args.tls_key_file and args.forward_ca_file
    assert not (args.insecure_listen_without_keys or args.insecure_etcd_http
                or args.insecure_forward_http or args.insecure_http_listen)
    found = exposure_check(listen_host=args.listen[0], api_keys=bool(args.api_key_file),
                           etcd_endpoint=job["EnvironmentVariables"]["MLX_FLEET_ETCD_ENDPOINT"],
                           etcd_password=False, tls=bool(args.tls_cert_file))
    assert found.refusals == () and found.warnings == ()


def test_router_launchd_plist_keeps_the_router_running_and_parses() -> None:
    from mlx_fleet_router.main import parse_args

    with ROUTER_PLIST.open("rb") as f:
        job = plistlib.load(f)
    assert job["Label"] == "io.mlx-fleet.router" == ROUTER_PLIST.stem
    assert job["RunAtLoad"] is True and job["KeepAlive"] is True
    assert job["StandardOutPath"] == job["StandardErrorPath"]
    assert job["StandardErrorPath"].startswith("/Library/Logs/")
    assert job["ProgramArguments"][0].endswith("/bin/mlx-fleet-router")
    args = parse_args(job["ProgramArguments"][1:])  # exits on an unknown or bad flag
    assert (args.listen, args.port, args.namespace) == ("0.0.0.0", 8090, ["default"])
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["mlx-fleet-router"] == "mlx_fleet_router.main:main"


def test_router_launchd_job_is_closed_by_default() -> None:
    """Issue 19: the router's job as the agent's — a dedicated user, keys, an https:// etcd
    with the router's own client certificate — and the router's own exposure check (what makes
    it refuse to start, or warn) finds nothing."""
    from mlx_fleet.exposure import (INSECURE_ETCD, INSECURE_FORWARD, INSECURE_HTTP_LISTEN,
                                    INSECURE_LISTEN, exposure_check)
    from mlx_fleet_router.main import parse_args

    with ROUTER_PLIST.open("rb") as f:
        job = plistlib.load(f)
    assert job.get("UserName") not in (None, "root", "")
    assert job.get("GroupName") not in (None, "wheel", "admin", "")
    assert job["Umask"] & 0o077 == 0o077
    env = job["EnvironmentVariables"]
    assert env["MLX_FLEET_ETCD_ENDPOINT"].startswith("https://")
    for var in ("MLX_FLEET_ETCD_CA_FILE", "MLX_FLEET_ETCD_CERT_FILE", "MLX_FLEET_ETCD_KEY_FILE"):
        assert env[var].startswith("/")
    assert "MLX_FLEET_ETCD_PASSWORD" not in env
    args = parse_args(job["ProgramArguments"][1:])
    assert args.api_key_file and args.forward_key_file and args.upstream_ca_file
    assert args.tls_cert_file and args.tls_key_file  # HTTPS: keys and prompts never in clear
    assert not any(getattr(args, f[2:].replace("-", "_"))
                   for f in (INSECURE_LISTEN, INSECURE_ETCD, INSECURE_FORWARD,
                             INSECURE_HTTP_LISTEN))
    found = exposure_check(listen_host=args.listen, api_keys=bool(args.api_key_file),
                           etcd_endpoint=env["MLX_FLEET_ETCD_ENDPOINT"], etcd_password=False,
                           tls=bool(args.tls_cert_file))
    assert found.refusals == () and found.warnings == ()


@pytest.mark.parametrize("plist", [PLIST, ROUTER_PLIST])
def test_launchd_jobs_may_open_more_files_than_the_connection_cap(plist: Path) -> None:
    """Review of issue 19: launchd's default soft open-file limit (256) is below the servers'
    --max-connections (512): each job raises it above the cap plus the servers' headroom."""
    from mlx_fleet.connection_limits import FD_HEADROOM
    from mlx_fleet.http_hygiene import HttpLimits

    with plist.open("rb") as f:
        job = plistlib.load(f)
    need = HttpLimits().max_connections + FD_HEADROOM
    assert job["SoftResourceLimits"]["NumberOfFiles"] >= need
    assert job["HardResourceLimits"]["NumberOfFiles"] >= job["SoftResourceLimits"]["NumberOfFiles"]


def test_plistlib_refuses_a_broken_plist() -> None:
    """The check above can fail: a truncated file is not a plist."""
    from xml.parsers.expat import ExpatError

    with pytest.raises((plistlib.InvalidFileException, ExpatError)):
        plistlib.loads(PLIST.read_bytes()[:-40])


def _dockerfile() -> list[str]:
    return [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_runs_the_operator_as_the_charts_non_root_user() -> None:
    lines = _dockerfile()
    values = yaml.safe_load((REPO / "charts" / "mlx-fleet" / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert f"USER {pod['runAsUser']}:{pod['runAsGroup']}" in lines
    assert lines[-1] == 'ENTRYPOINT ["mlx-fleet-operator"]'
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "mlx-fleet-operator" in scripts and "mlx-fleet-router" in scripts  # the chart's two commands
    exposed = {int(p) for line in lines if line.startswith("EXPOSE") for p in line.split()[1:]}
    assert exposed == {values["metrics"]["port"], values["health"]["port"], values["router"]["port"]}
    assert "HOME=/tmp" in " ".join(lines)  # the chart mounts a writable emptyDir there only


def test_dockerfile_copies_every_package_source_root() -> None:
    copied = {m.group(1) for line in _dockerfile()
              if (m := re.match(r"COPY (\S+) \./", line))}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    roots = {d.split("/")[0] for d in project["tool"]["setuptools"]["package-dir"].values()}
    assert roots <= copied, roots - copied
    for src in copied:
        assert (REPO / src).exists(), src


def test_every_python_package_is_in_the_distribution() -> None:
    """``pip install .`` (the Dockerfile, the Macs' install) ships only the packages listed in
    pyproject's ``[tool.setuptools] packages``: every directory with an ``__init__.py`` under a
    package root must be listed (node_agent.serving once was not)."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, root in setup["package-dir"].items():
        for init in (REPO / root).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / root)
            found.add(".".join([name, *rel.parts]))
    assert found == set(setup["packages"]), found ^ set(setup["packages"])
