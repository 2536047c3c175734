"""Two ``provision`` runs at once (issue 8 §2): one builds, the other waits for it and returns
what it built; the shared work directory is never used by both. Real processes, a trivial fake
build step (no Go): :func:`mlx_fleet.devcluster.binaries.build_once` is what every
``ensure_*`` (etcd, kube-apiserver/kubectl, helm, prometheus) builds through.

The fake build announces itself on stdout, then blocks reading a FIFO until the test writes to
it, so the second run is known to start while the first one is building.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from fault_record import FaultRecord

BUILDER = """
import pathlib, sys
from mlx_fleet.devcluster.binaries import build_once, cache_dir
out = cache_dir() / "bin" / "fake-1" / "fake"
def build(work, log):
    with open(work / "builds", "a") as f:
        f.write(f"{sys.argv[2]}\\n")
    print("building", flush=True)
    pathlib.Path(sys.argv[1]).read_text()  # a FIFO: blocks until the test writes
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(sys.argv[2])
    return out
print(build_once("fake-1", lambda: out if out.is_file() else None, build), flush=True)
"""


async def start(gate: Path, who: str, cache: Path) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-c", BUILDER, str(gate), who, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "MLX_FLEET_CACHE": str(cache)})


@pytest.mark.fault("two `provision` runs at once",
                   holds="one builds, the other logs that it waits, waits, and returns the same "
                         "binary; the build ran once")
async def test_second_provision_waits_for_the_first(tmp_path: Path, fault_record: FaultRecord) -> None:
    cache, gate = tmp_path / "cache", tmp_path / "gate"
    os.mkfifo(gate)
    first = await start(gate, "first", cache)
    second = None
    try:
        assert await asyncio.wait_for(first.stdout.readline(), 60) == b"building\n"
        second = await start(gate, "second", cache)
        waiting = await asyncio.wait_for(second.stderr.readline(), 60)
        assert b"another provision is building fake-1; waiting" in waiting, waiting
        assert second.returncode is None and first.returncode is None

        def release() -> None:
            with open(gate, "w") as g:  # the first build's read returns
                g.write("go")

        await asyncio.to_thread(release)
        out1, err1 = await asyncio.wait_for(first.communicate(), 60)
        out2, err2 = await asyncio.wait_for(second.communicate(), 60)
    finally:
        for p in (first, second):
            if p is not None and p.returncode is None:
                p.kill()
                await p.wait()
    assert first.returncode == 0, err1
    assert second.returncode == 0, err2
    binary = cache / "bin" / "fake-1" / "fake"
    assert out1.decode().splitlines() == [str(binary)]  # after "building", read above
    assert out2.decode().splitlines() == [str(binary)]  # it never printed "building"
    assert (cache / "build" / "fake-1" / "builds").read_text() == "first\n"
    assert binary.read_text() == "first"
    fault_record.note("the second run waited on the build lock and returned the first run's binary")
