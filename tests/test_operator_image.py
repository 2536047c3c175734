"""The operator image's entry point as the chart runs it: uid/gid 65532 with no passwd entry,
only the image's own environment, on a real API server.

kopf's default peering identity calls ``getpass.getuser()``, which raises ``KeyError:
'getpwuid(): uid not found: 65532'`` for such a uid: the chart's Pod crash-looped at start in a
real cluster (issue 18). The operator now names itself (``own_identity``); this starts the
Dockerfile's ``ENTRYPOINT`` under the Dockerfile's ``USER`` and ``ENV`` and waits for /healthz.
(The image itself is built and run on a real kubelet by the real-node tests.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import pytest

from mlx_fleet.devcluster.processes import ManagedProcess, free_port

REPO = Path(__file__).resolve().parents[1]


def _dockerfile_final_stage() -> list[str]:
    lines = [line.strip() for line in (REPO / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    return lines[last_from:]


def image_user() -> tuple[int, int]:
    """The final stage's ``USER uid:gid``."""
    users = [line.split()[1] for line in _dockerfile_final_stage() if line.startswith("USER ")]
    uid, gid = users[-1].split(":")
    return int(uid), int(gid)


def image_env() -> dict[str, str]:
    """The final stage's ``ENV k=v ...`` lines (the only form the Dockerfile uses)."""
    env: dict[str, str] = {}
    for line in _dockerfile_final_stage():
        if line.startswith("ENV "):
            env.update(dict(re.findall(r"(\w+)=(\S+)", line[4:])))
    return env


def image_entrypoint() -> list[str]:
    (line,) = [line for line in _dockerfile_final_stage() if line.startswith("ENTRYPOINT ")]
    return json.loads(line.removeprefix("ENTRYPOINT "))


def test_own_identity_prefers_the_pod_name_and_is_unique_per_process() -> None:
    from mlx_fleet_operator.main import own_identity

    a, b = own_identity({"POD_NAME": "mlx-fleet-7d9-x2"}), own_identity({"POD_NAME": "mlx-fleet-7d9-x2"})
    assert a.startswith("mlx-fleet-7d9-x2/") and a != b
    assert own_identity({}).split("/")[0]  # the host name when not in a Pod


def test_dockerfile_user_has_no_name_here() -> None:
    """The reproduction below is only meaningful for a uid without a passwd entry."""
    import pwd

    uid, _ = image_user()
    with pytest.raises(KeyError):
        pwd.getpwuid(uid)


@pytest.mark.integration
def test_entry_point_as_the_images_user_gets_past_start_up(control_plane, tmp_path) -> None:
    # Never a skip: like the real-node test, a missing prerequisite fails in one line.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("running the image's entry point as its uid needs root and util-linux's "
                    "setpriv (the suite runs as root in CI)", pytrace=False)
    uid, gid = image_user()
    entry = [str(Path(sys.executable).with_name(image_entrypoint()[0])), *image_entrypoint()[1:]]
    liveness, metrics = free_port(), free_port()
    # Only what a container would have: the image's ENV, the Pod's env (the chart sets no USER
    # or LOGNAME), a PATH. CAP_DAC_READ_SEARCH lets the unprivileged uid read the virtualenv and
    # kubeconfig under /root, as the image's files would be readable; it grants no identity.
    env = {**image_env(), "PATH": control_plane.env()["PATH"],
           "KUBECONFIG": control_plane.env()["KUBECONFIG"]}
    assert not {"USER", "LOGNAME", "LNAME", "USERNAME"} & env.keys()
    argv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
            "env", "-i", *(f"{k}={v}" for k, v in env.items()),
            *entry, "--etcd-endpoint", control_plane.etcd_url, "--etcd-prefix", "/mlx-fleet-image-test",
            "--metrics-port", str(metrics), "--liveness-port", str(liveness), "--namespace", "image-test"]
    proc = ManagedProcess("operator as uid 65532", argv, tmp_path / "operator.log")

    def live() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=2) as r:
            return r.status == 200

    try:
        proc.wait_until(live, timeout=60, what="live (/healthz)")  # raises with the log on a crash
        assert "getpwuid" not in proc.log_tail(200)
        assert proc.alive()
    finally:
        proc.stop()
