"""Bounded, verified, content-addressed downloads (issue 19, findings 3 and 4): every manifest
entry has a size and a sha256, the download fits the disk's reserve and the cache's cap before
its first byte, never takes a byte beyond the declared size, and the cache is
garbage-collected (``.part`` files and sources no longer assigned, least recently used first,
never what is assigned, loaded or downloading)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import namedtuple
from pathlib import Path

import pytest
from filelock import FileLock

from node_agent.fetch import (STATE_FILE, DownloadLimits, collect_garbage, digest_of,
                              mirror_dir)
from node_agent.fetch.bounds import (hub_need, manifest_digest, parse_reserve, room_refusal,
                                     unpinned_refusal)
from node_agent.fetch.gc import CacheEntry, Deletion, PartFile, gc_plan
from node_agent.model_dir import SourceError
from mlx_fleet.quantity import parse_quantity
from test_agent_controller import core  # noqa: F401
from mlx_fleet.source_policy import DEV_POLICY
# test_sources' fetch: under its explicit source policy (the mirror is on 127.0.0.1)
from test_sources import (Mirror, assert_same_files, fetch, mirror, model_files,  # noqa: F401
                          store, tls)

GiB = 2**30
Usage = namedtuple("Usage", "total used free")


def disk(total: int, free: int):
    """A ``shutil.disk_usage`` stand-in: a real full disk can't be made here."""
    return lambda _path: Usage(total, total - free, free)


def files_fetched(m: Mirror) -> list[str]:
    return [n for n, _ in m.requests if n != "manifest.json"]


# ---------------------------------------------------------------------------------------------
# the manifest: sizes and digests required, refused before any byte
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["size", "sha256"])
async def test_an_entry_without_size_or_sha256_is_refused_before_any_byte(
        mirror: Mirror, tmp_path: Path, missing: str) -> None:
    entry = next(f for f in mirror.manifest["files"] if f["path"] == "model.safetensors")
    del entry[missing]
    mirror.chunked.add("model.safetensors")  # no Content-Length either: nothing bounds it
    mirror.extra["model.safetensors"] = 8 * 2**20
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert e.value.reason == "InvalidSource"
    assert "model.safetensors" in e.value.message and repr(missing) in e.value.message
    assert files_fetched(mirror) == []
    assert not list(tmp_path.rglob("*.safetensors*"))


async def test_a_declared_petabyte_file_is_refused_before_any_byte(mirror: Mirror,
                                                                    tmp_path: Path) -> None:
    entry = next(f for f in mirror.manifest["files"] if f["path"] == "model.safetensors")
    entry["size"] = 10**15
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)  # the real disk of this machine
    assert e.value.reason == "InsufficientDisk"
    assert "needs 1000000" in e.value.message and "--model-cache-reserve" in e.value.message
    assert files_fetched(mirror) == []


async def test_bytes_beyond_the_declared_size_abort_the_download(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    mirror.chunked.add("model.safetensors")
    mirror.extra["model.safetensors"] = 64 * 2**20
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert e.value.reason == "DownloadCorrupt"
    assert "model.safetensors" in e.value.message and "more than the expected" in e.value.message
    target = mirror_dir(mirror.url, tmp_path)
    assert not (target / "model.safetensors").exists()
    assert not (target / "model.safetensors.part").exists()
    # the same file without the surplus downloads and verifies
    mirror.extra.clear()
    assert_same_files(await fetch(mirror.url, tmp_path), model_files)


async def test_a_sha256_mismatch_deletes_the_part_file(mirror: Mirror, tmp_path: Path) -> None:
    entry = next(f for f in mirror.manifest["files"] if f["path"] == "model.safetensors")
    entry["sha256"] = "0" * 64
    mirror.chunked.add("model.safetensors")
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert e.value.reason == "DownloadCorrupt" and "sha256" in e.value.message
    target = mirror_dir(mirror.url, tmp_path)
    assert not (target / "model.safetensors").exists()
    assert not (target / "model.safetensors.part").exists()


# ---------------------------------------------------------------------------------------------
# disk bounds before the first byte
# ---------------------------------------------------------------------------------------------


async def test_free_space_below_the_reserve_is_refused(mirror: Mirror, tmp_path: Path,
                                                        model_files: dict[str, bytes]) -> None:
    need = mirror.total
    total = 100 * GiB  # 10 % reserve: 10 GiB
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path, disk_usage=disk(total, 10 * GiB + need - 1))
    assert e.value.reason == "InsufficientDisk"
    assert f"needs {need} more bytes" in e.value.message
    assert f"keeps {10 * GiB} in reserve" in e.value.message
    assert files_fetched(mirror) == []
    # a reserve in bytes, larger than 10 %, counts too
    with pytest.raises(SourceError):
        await fetch(mirror.url, tmp_path, disk_usage=disk(total, 12 * GiB),
                    limits=DownloadLimits(reserve_bytes=20 * GiB))
    assert files_fetched(mirror) == []
    path = await fetch(mirror.url, tmp_path, disk_usage=disk(total, 10 * GiB + need))
    assert_same_files(path, model_files)


async def test_the_cache_cap_is_checked_and_make_room_is_asked_first(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    old = tmp_path / "https" / "old-mirror"
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(bytes(4000))
    # the old download must go for this one (and its ~1 kB state file) to fit
    cap = mirror.total + 2500
    asked: list[tuple[int, int]] = []

    async def no_room(need: int, shortfall: int) -> None:
        asked.append((need, shortfall))

    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path, limits=DownloadLimits(cache_max_bytes=cap),
                    make_room=no_room)
    assert e.value.reason == "InsufficientDisk" and "--model-cache-max-bytes" in e.value.message
    assert asked == [(mirror.total, 0)] and files_fetched(mirror) == []

    async def collect(need: int, shortfall: int) -> None:
        collect_garbage(tmp_path, assigned=[mirror_dir(mirror.url, tmp_path).name], loaded=[],
                        limits=DownloadLimits(cache_max_bytes=cap), now=time.time(), need=need,
                        shortfall=shortfall)

    path = await fetch(mirror.url, tmp_path, limits=DownloadLimits(cache_max_bytes=cap),
                       make_room=collect)
    assert_same_files(path, model_files)
    assert not old.exists()
    assert digest_of(path) == manifest_digest((f["path"], f["sha256"])
                                              for f in mirror.manifest["files"])


@pytest.mark.parametrize(("need", "free", "held", "limits", "refused"), [
    (10, 100 * GiB, 0, DownloadLimits(), None),
    (10 * GiB, 19 * GiB, 0, DownloadLimits(), "reserve"),          # 10 % of 100 GiB kept
    (9 * GiB, 19 * GiB, 0, DownloadLimits(), None),
    (9 * GiB, 19 * GiB, 0, DownloadLimits(reserve_fraction=0.2), "reserve"),
    (1, 5 * GiB, 0, DownloadLimits(reserve_bytes=5 * GiB, reserve_fraction=0), "reserve"),
    (1, 5 * GiB, 0, DownloadLimits(reserve_bytes=0, reserve_fraction=0), None),
    (10**15, 100 * GiB, 0, DownloadLimits(), "reserve"),
    (GiB, 90 * GiB, 3 * GiB, DownloadLimits(cache_max_bytes=4 * GiB), None),
    (GiB + 1, 90 * GiB, 3 * GiB, DownloadLimits(cache_max_bytes=4 * GiB), "cap"),
    (0, 0, 0, DownloadLimits(reserve_fraction=0), None),
])
def test_room_refusal_table(need: int, free: int, held: int, limits: DownloadLimits,
                            refused: str | None) -> None:
    r = room_refusal(need, free=free, fs_total=100 * GiB, cache_bytes=held, limits=limits,
                     what="https://mirror.example/m/")
    if refused is None:
        assert r is None
    else:
        assert r is not None and r.reason == "InsufficientDisk"
        assert ("--model-cache-max-bytes" if refused == "cap" else "--model-cache-reserve") in (
            r.message)
        assert "https://mirror.example/m/" in r.message and f"needs {need}" in r.message


def test_limits_and_reserve_parsing() -> None:
    assert parse_reserve("10%", parse_quantity) == (0, 0.10)
    assert parse_reserve("20Gi", parse_quantity) == (20 * GiB, 0.0)
    assert parse_reserve("0", parse_quantity) == (0, 0.0)
    for bad in ("100%", "-1%", "x%", "lots"):
        with pytest.raises(ValueError):
            parse_reserve(bad, parse_quantity)
    for kwargs in ({"reserve_fraction": 1.0}, {"reserve_bytes": -1}, {"cache_max_bytes": -1},
                   {"unused_max_age_s": -1}):
        with pytest.raises(ValueError):
            DownloadLimits(**kwargs)
    assert DownloadLimits().reserve(1000) == 100
    assert DownloadLimits(reserve_bytes=300).reserve(1000) == 300


def test_digests() -> None:
    a, b = "ab" * 32, "cd" * 32
    d = manifest_digest([("config.json", a), ("model.safetensors", b)])
    assert d.startswith("sha256:") and len(d) == 7 + 64
    assert d == manifest_digest([("model.safetensors", b), ("config.json", a.upper())])
    assert d != manifest_digest([("config.json", b), ("model.safetensors", a)])
    assert unpinned_refusal("hf://o/r@" + "a" * 40, "a" * 40, allow=False) is None
    assert unpinned_refusal("hf://o/r", None, allow=True) is None
    r = unpinned_refusal("hf://o/r@main", "main", allow=False)
    assert r is not None and r.reason == "InvalidSource" and "hf://o/r@main" in r.message


def test_hub_need() -> None:
    """The dry run's bytes to fetch; a file to fetch without a size refuses (fail closed)."""
    assert hub_need([("a", 10, True), ("b", 5, False), ("c", None, False), ("d", 0, True)],
                    what="hf://o/r") == 10
    assert hub_need([], what="hf://o/r") == 0
    with pytest.raises(SourceError) as e:
        hub_need([("config.json", 10, True), ("model.safetensors", None, True)],
                 what="hf://o/r@main")
    assert e.value.reason == "InvalidSource"
    assert "did not say the size of model.safetensors" in e.value.message


# ---------------------------------------------------------------------------------------------
# garbage collection: the pure plan
# ---------------------------------------------------------------------------------------------

NOW = 1_000_000.0
HOUR = 3600.0


def entry(name: str, size: int, age: float, *, active: bool = False,
          parts: tuple[tuple[str, int, float], ...] = (), group: str = "") -> CacheEntry:
    return CacheEntry(name, size, NOW - age, active,
                      tuple(PartFile(p, b, NOW - a) for p, b, a in parts), group)


def plan(entries, assigned=(), loaded=(), cap=0, **kw) -> list[tuple]:
    return [(d.name, d.part, d.reason) for d in gc_plan(
        entries, assigned, loaded, NOW, cap, unused_max_age_s=HOUR, part_max_age_s=24 * HOUR,
        **kw)]


@pytest.mark.parametrize(("entries", "assigned", "loaded", "cap", "kw", "expected"), [
    # nothing cached, nothing to do
    ([], (), (), 0, {}, []),
    # an unassigned source unused for an hour goes; a recent one stays (no pressure)
    ([entry("old", 10, 2 * HOUR), entry("new", 10, 60)], (), (), 0, {},
     [("old", None, "Unassigned")]),
    # never what is assigned (standby included), loaded, or downloading, however old
    ([entry("a", 10, 99 * HOUR), entry("l", 10, 99 * HOUR),
      entry("d", 10, 99 * HOUR, active=True)], ("a",), ("l",), 0, {}, []),
    # least recently used first
    ([entry("b", 10, 3 * HOUR), entry("a", 10, 5 * HOUR), entry("c", 10, 4 * HOUR)],
     (), (), 0, {}, [("a", None, "Unassigned"), ("c", None, "Unassigned"),
                     ("b", None, "Unassigned")]),
    # over the cap: recent unassigned ones go too, LRU first, only as many as needed
    ([entry("x", 50, 60), entry("y", 50, 120), entry("z", 50, 30), entry("keep", 50, 10)],
     ("keep",), (), 150, {"need": 50}, [("y", None, "SpaceNeeded"), ("x", None, "SpaceNeeded")]),
    # under the cap after the new download: nothing recent goes
    ([entry("x", 50, 60), entry("keep", 50, 10)], ("keep",), (), 150, {"need": 50}, []),
    # the disk lacks bytes: LRU unassigned go until they are freed
    ([entry("x", 50, 60), entry("y", 50, 120), entry("z", 50, 30)], (), (), 0,
     {"shortfall": 60}, [("y", None, "SpaceNeeded"), ("x", None, "SpaceNeeded")]),
    # a shortfall no deletion covers: every unprotected one goes, nothing protected
    ([entry("x", 50, 60), entry("keep", 500, 10)], ("keep",), ("keep",), 0,
     {"shortfall": 10**15}, [("x", None, "SpaceNeeded")]),
    # stale .part files of an assigned, idle source go; fresh ones and an active one's stay
    ([entry("a", 30, 10, parts=(("m.part", 20, 25 * HOUR), ("t.part", 5, 60))),
      entry("d", 30, 10, active=True, parts=(("m.part", 20, 99 * HOUR),))],
     ("a", "d"), (), 0, {}, [("a", "m.part", "StalePart")]),
    # an active unassigned download is never touched
    ([entry("d", 30, 99 * HOUR, active=True, parts=(("m.part", 20, 99 * HOUR),))],
     (), (), 1, {"shortfall": 100}, []),
    # hub revisions: a pinned assignment keeps its revision only; the repo's others go
    ([entry("hf@m@a", 10, 99 * HOUR, group="hf@m"), entry("hf@m@b", 10, 98 * HOUR, group="hf@m")],
     ("hf@m@a",), (), 0, {}, [("hf@m@b", None, "Unassigned")]),
    # an unpinned hf:// source (its group) keeps every revision of its repository
    ([entry("hf@m@a", 10, 99 * HOUR, group="hf@m"), entry("hf@m@b", 10, 98 * HOUR, group="hf@m"),
      entry("hf@n@c", 10, 97 * HOUR, group="hf@n")],
     ("hf@m",), (), 0, {}, [("hf@n@c", None, "Unassigned")]),
    # loaded by its group too; mirrors and hub revisions share the cap, LRU first
    ([entry("hf@m@a", 50, 60, group="hf@m"), entry("mirror", 50, 120),
      entry("hf@n@c", 50, 30, group="hf@n")],
     (), ("hf@n",), 100, {"need": 50}, [("mirror", None, "SpaceNeeded"),
                                        ("hf@m@a", None, "SpaceNeeded")]),
])
def test_gc_plan_table(entries, assigned, loaded, cap, kw, expected) -> None:
    assert plan(entries, assigned, loaded, cap, **kw) == expected


def test_gc_plan_counts_bytes() -> None:
    [d] = gc_plan([entry("old", 123, 2 * HOUR)], (), (), NOW, 0, unused_max_age_s=HOUR,
                  part_max_age_s=HOUR)
    assert d == Deletion("old", 123, "Unassigned")


# ---------------------------------------------------------------------------------------------
# garbage collection: the executor on a real cache directory
# ---------------------------------------------------------------------------------------------


def cached(root: Path, name: str, files: dict[str, int], *, age: float,
           parts: dict[str, tuple[int, float]] | None = None) -> Path:
    d = root / "https" / name
    d.mkdir(parents=True)
    for f, size in files.items():
        (d / f).write_bytes(bytes(size))
    (d / STATE_FILE).write_text('{"uri": "https://mirror.example/%s/", "complete": true, '
                                '"files": []}' % name)
    os.utime(d / STATE_FILE, (time.time() - age, time.time() - age))
    for f, (size, part_age) in (parts or {}).items():
        (d / f).write_bytes(bytes(size))
        os.utime(d / f, (time.time() - part_age, time.time() - part_age))
    return d


def test_collect_garbage_on_a_real_cache(tmp_path: Path) -> None:
    assigned = cached(tmp_path, "assigned", {"config.json": 10},
                      age=5 * HOUR, parts={"model.safetensors.part": (1000, 48 * HOUR),
                                           "tokenizer.json.part": (10, 60)})
    gone = cached(tmp_path, "unassigned-old", {"config.json": 10, "model.safetensors": 500},
                  age=2 * HOUR)
    recent = cached(tmp_path, "unassigned-recent", {"config.json": 10}, age=60)
    busy = cached(tmp_path, "downloading", {}, age=9 * HOUR,
                  parts={"model.safetensors.part": (100, 48 * HOUR)})
    state_bytes = len((gone / STATE_FILE).read_bytes())
    lock = FileLock(f"{busy}.lock")  # a download in progress holds its lock
    lock.acquire()
    try:
        done = collect_garbage(tmp_path, assigned=["assigned"], loaded=[],
                               limits=DownloadLimits(), now=time.time())
    finally:
        lock.release()
    assert [(d.name, d.part, d.reason, d.bytes) for d in done] == [
        ("assigned", "model.safetensors.part", "StalePart", 1000),
        ("unassigned-old", None, "Unassigned", 510 + state_bytes)]
    assert not gone.exists()
    assert not (assigned / "model.safetensors.part").exists()
    assert (assigned / "tokenizer.json.part").exists() and (assigned / "config.json").exists()
    assert recent.exists()
    assert (busy / "model.safetensors.part").exists()

    # the cache over its cap: the recent unassigned one goes too; never the assigned one
    done = collect_garbage(tmp_path, assigned=["assigned"], loaded=[],
                           limits=DownloadLimits(cache_max_bytes=1), now=time.time())
    assert {d.name for d in done} == {"unassigned-recent", "downloading"}
    assert assigned.exists() and not recent.exists()


def test_agents_sharing_a_cache_keep_each_others_sources(tmp_path: Path) -> None:
    """Two agents on one host (a development fleet) share ``$MLX_FLEET_CACHE``: each holds an
    in-use lock on its own sources, so the other's collector leaves them alone."""
    from node_agent.fetch.cache import SourceHolds

    mine = cached(tmp_path, "mine", {"config.json": 10}, age=9 * HOUR)
    theirs = cached(tmp_path, "theirs", {"config.json": 10}, age=9 * HOUR)
    other_agent = SourceHolds(tmp_path)
    other_agent.hold(["theirs"])
    try:
        done = collect_garbage(tmp_path, assigned=["mine"], loaded=[], limits=DownloadLimits(),
                               now=time.time())
        assert done == [] and mine.exists() and theirs.exists()
        other_agent.hold([])  # unassigned there too
        done = collect_garbage(tmp_path, assigned=["mine"], loaded=[], limits=DownloadLimits(),
                               now=time.time())
        assert [d.name for d in done] == ["theirs"] and not theirs.exists() and mine.exists()
    finally:
        other_agent.close()


# ---------------------------------------------------------------------------------------------
# the agent: digests reported, the cache collected after an unassignment
# ---------------------------------------------------------------------------------------------


async def test_an_unassigned_source_is_collected_and_an_assigned_one_kept(
        store, keys, core, tmp_path: Path, mirror: Mirror) -> None:  # noqa: F811
    from mlx_fleet.contract import AssignmentState
    from node_agent.controller import Controller
    from node_agent.registration import Registration
    from test_agent_controller import ADVERTISED, NODE, Capacity
    from test_sources import https_assignment, report_events, settled

    reg = Registration(store, keys, node_name=NODE, address=ADVERTISED, capacity=Capacity(),
                       ttl=5)
    await reg.start()
    cache = tmp_path / "cache"
    stray = cache / "https" / "stray-download"  # from before: no longer assigned
    stray.mkdir(parents=True)
    (stray / "model.safetensors.part").write_bytes(bytes(100))
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=reg,
                     advertise_url=ADVERTISED, model_cache=cache,
                     download_limits=DownloadLimits(unused_max_age_s=0),
                     source_policy=DEV_POLICY)
    await ctl.start()
    try:
        await asyncio.wait_for(ctl.cache_collected.wait(), 30)  # on start
        assert not stray.exists()
        start = (await store.list(keys.root + "/")).revision + 1
        akey = keys.assignment(NODE, "default", "remote", "r1")
        await store.put(akey, https_assignment("remote", mirror.url).to_json())
        rkey = keys.report(NODE, "default", "remote", "r1")
        seen = await report_events(store, rkey, start, settled)
        assert seen[-1] is not None and seen[-1].state == AssignmentState.READY
        target = mirror_dir(mirror.url, cache)
        assert seen[-1].digest == digest_of(target) and seen[-1].digest.startswith("sha256:")
        ctl.cache_collected.clear()
        await store.delete(akey)
        await report_events(store, rkey, start, lambda r: r is None)
        await asyncio.wait_for(ctl.cache_collected.wait(), 30)  # after the unassignment
        assert not target.exists()
        registry = core.metrics.registry
        assert registry.get_sample_value("mlxfleet_agent_model_cache_deleted_bytes_total",
                                         {"reason": "Unassigned"}) >= mirror.total + 100
        assert registry.get_sample_value("mlxfleet_agent_model_cache_bytes") == 0
    finally:
        await ctl.stop()
        for m in core.models():
            await core.unload_model(m.model_id, m.revision)
        await reg.stop()


# ---------------------------------------------------------------------------------------------
# mlx-fleet make-manifest: what a mirror needs
# ---------------------------------------------------------------------------------------------


def test_make_manifest_writes_what_the_agent_requires(test_model_dir: Path, tmp_path: Path,
                                                      mirror: Mirror) -> None:  # noqa: F811
    import shutil

    from mlx_fleet.cli import main as fleet_main
    from mlx_fleet.mirror_manifest import build_manifest
    from node_agent.fetch import parse_manifest

    model = tmp_path / "model"
    shutil.copytree(test_model_dir, model)
    (model / ".mlx-fleet-download.json").write_text("{}")  # hidden: left out
    (model / "model.safetensors.part").write_bytes(b"x")   # partial: left out
    assert fleet_main(["make-manifest", str(model)]) == 0
    written = json.loads((model / "manifest.json").read_text())
    assert written == mirror.manifest == build_manifest(test_model_dir)  # the fixture's own
    assert parse_manifest(json.dumps(written))[0].path == "config.json"

    (model / "modeling_evil.py").write_text("raise SystemExit")
    with pytest.raises(ValueError, match="modeling_evil.py is Python code"):
        build_manifest(model)
    assert fleet_main(["make-manifest", str(tmp_path / "absent")]) == 2


async def test_an_hf_download_is_checked_against_the_disk_before_its_first_byte(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """huggingface_hub's dry run (the files it would fetch, with their sizes) is checked
    against the Hugging Face cache's disk minus the reserve: refused with no file body
    fetched; then, with room, the download runs."""
    from aiohttp import web

    from test_sources import COMMIT_MAIN, FakeHub

    hub = FakeHub(model_files, COMMIT_MAIN)
    runner = web.AppRunner(hub.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    need = sum(map(len, model_files.values()))
    uri = f"hf://hub-org/tiny@{COMMIT_MAIN}"
    try:
        with pytest.raises(SourceError) as e:
            await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                        offline=False, disk_usage=disk(100 * GiB, 10 * GiB + need - 1))
        assert e.value.reason == "InsufficientDisk" and f"needs {need} more bytes" in (
            e.value.message)
        assert [m for m, _ in hub.requests if m == "GET"] == []  # no body fetched
        # the agent's own Hugging Face cache (<model cache>/hf) counts under the cap
        with pytest.raises(SourceError) as e:
            await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                        offline=False, disk_usage=disk(100 * GiB, 10 * GiB + need),
                        limits=DownloadLimits(cache_max_bytes=need - 1))
        assert e.value.reason == "InsufficientDisk" and "--model-cache-max-bytes" in (
            e.value.message)
        assert [m for m, _ in hub.requests if m == "GET"] == []
        # a Hugging Face cache elsewhere ($HF_HUB_CACHE, shared with other tools) is not the
        # model cache's: only the disk's reserve applies to it
        shared = await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "shared-hf",
                             hf_endpoint=endpoint, offline=False,
                             disk_usage=disk(100 * GiB, 10 * GiB + need),
                             limits=DownloadLimits(cache_max_bytes=1))
        path = await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                           offline=False, disk_usage=disk(100 * GiB, 10 * GiB + need),
                           limits=DownloadLimits(cache_max_bytes=need))
    finally:
        await runner.cleanup()
    assert_same_files(shared, model_files)
    assert_same_files(path, model_files)


def test_agent_flags() -> None:
    from node_agent.cli import build_parser, config_from_args

    def config(*argv: str):
        return config_from_args(build_parser().parse_args(list(argv))).downloads

    assert config() == DownloadLimits()  # 10 %, no cap, commits only, an hour
    got = config("--model-cache-reserve", "20Gi", "--model-cache-max-bytes", "200Gi",
                 "--model-cache-unused-seconds", "60", "--allow-unpinned-hub-revisions")
    assert got == DownloadLimits(reserve_bytes=20 * GiB, reserve_fraction=0.0,
                                 cache_max_bytes=200 * GiB, allow_unpinned_hub=True,
                                 unused_max_age_s=60)
    assert config("--model-cache-reserve", "5%").reserve_fraction == 0.05
    for bad in (["--model-cache-reserve", "100%"], ["--model-cache-reserve", "lots"],
                ["--model-cache-max-bytes", "-1"], ["--model-cache-unused-seconds", "-1"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(bad)
        assert e.value.code == 2, bad


# ---------------------------------------------------------------------------------------------
# hf://: fail closed without sizes; the agent's own Hugging Face cache capped and collected
# ---------------------------------------------------------------------------------------------


class ListingHub:
    """test_sources' FakeHub, whose file listing (what the dry run reads) can fail its next
    ``fail`` requests (HTTP 403, not retried) or give no size for the files in ``sizeless``
    (none in the listing, no ``Content-Length`` in the ``HEAD`` answer)."""

    def __init__(self, files: dict[str, bytes], commit: str) -> None:
        from test_sources import FakeHub

        self.hub = FakeHub(files, commit)
        self.fail = 0
        self.sizeless: set[str] = set()

    def app(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self.hub.revision)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self.tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file}", self.resolve)
        app.router.add_get("/api/models/{org}/{name}/refs", self.hub.refs)
        app.router.add_get("/api/models/{org}/{name}/commits/{rev:.+}", self.hub.commits)
        return app

    async def resolve(self, request):
        from aiohttp import web

        name = request.match_info["file"]
        if request.method != "HEAD" or name not in self.sizeless:
            return await self.hub.resolve(request)
        self.hub.requests.append((request.method, name))
        resp = web.StreamResponse(headers={
            "X-Repo-Commit": self.hub.commit,
            "ETag": '"%s"' % hashlib.sha256(self.hub.files[name]).hexdigest()})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write_eof()
        return resp

    async def tree(self, request):
        from aiohttp import web

        if self.fail > 0:
            self.fail -= 1
            return web.json_response({"error": "listing unavailable"}, status=403)
        listing = json.loads((await self.hub.tree(request)).text)
        for item in listing:
            if item["path"] in self.sizeless:
                item["size"] = None
        return web.json_response(listing)

    def bodies(self) -> list[str]:
        return [f for m, f in self.hub.requests if m == "GET"]


class serve_hub:  # noqa: N801 - an async context manager, used like a function
    """``async with serve_hub(hub) as endpoint``: ``hub.app()`` on 127.0.0.1."""

    def __init__(self, hub) -> None:
        self.hub = hub

    async def __aenter__(self) -> str:
        from aiohttp import web

        self.runner = web.AppRunner(self.hub.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


async def test_an_hf_download_whose_listing_fails_is_refused_not_unchecked(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """The dry run (the files and their sizes) fails: nothing is fetched, unchecked — the
    download fails DownloadFailed (retried later); a revision already cached is used as it
    is, with nothing fetched."""
    from test_sources import COMMIT_MAIN

    hub = ListingHub(model_files, COMMIT_MAIN)
    uri = f"hf://hub-org/tiny@{COMMIT_MAIN}"
    async with serve_hub(hub) as endpoint:
        hub.fail = 1  # only the dry run's listing: the download's own would succeed
        with pytest.raises(SourceError) as e:
            await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                        offline=False)
        assert e.value.reason == "DownloadFailed"
        assert "did not list the files to fetch and their sizes" in e.value.message
        assert hub.bodies() == []
        path = await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                           offline=False)
        assert_same_files(path, model_files)
        fetched = len(hub.bodies())
        hub.fail = 10**6  # the hub can't list anything now: the cached revision serves
        again = await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                            offline=False)
        assert again == path and len(hub.bodies()) == fetched


async def test_an_hf_file_without_a_size_is_refused(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    from test_sources import COMMIT_MAIN

    hub = ListingHub(model_files, COMMIT_MAIN)
    hub.sizeless.add("model.safetensors")
    async with serve_hub(hub) as endpoint:
        with pytest.raises(SourceError) as e:
            await fetch(f"hf://hub-org/tiny@{COMMIT_MAIN}", tmp_path,
                        hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False)
    assert e.value.reason == "InvalidSource", e.value
    assert "the hub did not say the size of model.safetensors" in e.value.message
    assert hub.bodies() == []


def revision_name(repo_id: str, commit: str | None = None) -> str:
    """The garbage collector's name of a revision (or group) in the agent's HF cache."""
    from node_agent.fetch import cache_entry_name

    uri = f"hf://{repo_id}" + (f"@{commit}" if commit else "")
    found = cache_entry_name(uri, Path("/cache"))
    assert found is not None
    return found[0]


async def test_unassigned_hf_revisions_are_collected_with_huggingface_hub(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """Two revisions of one repository, downloaded by huggingface_hub into the agent's own
    Hugging Face cache (<model cache>/hf): the one not assigned goes (its blobs the other
    shares stay), an assigned or loaded revision or group never goes."""
    from test_sources import COMMIT_MAIN, COMMIT_V1

    v1 = {**model_files, "config.json": json.dumps(
        {**json.loads(model_files["config.json"]), "mlx_fleet_test": "v1"}).encode()}
    paths = {}
    for commit, files in ((COMMIT_MAIN, model_files), (COMMIT_V1, v1)):
        async with serve_hub(ListingHub(files, commit)) as endpoint:
            paths[commit] = await fetch(f"hf://hub-org/tiny@{commit}", tmp_path,
                                        hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                                        offline=False)
    repo = tmp_path / "hf" / "models--hub-org--tiny"
    assert len(list((repo / "blobs").iterdir())) == len(model_files) + 1
    limits = DownloadLimits(unused_max_age_s=0)
    later = time.time() + 1
    group = revision_name("hub-org/tiny")
    main, kept = revision_name("hub-org/tiny", COMMIT_MAIN), revision_name("hub-org/tiny",
                                                                           COMMIT_V1)
    assert main == f"hf@models--hub-org--tiny@{COMMIT_MAIN}"
    # an unpinned assignment (the group) or a loaded one keeps every revision
    assert collect_garbage(tmp_path, assigned=[group], loaded=(), limits=limits, now=later) == []
    assert collect_garbage(tmp_path, assigned=(), loaded=[group], limits=limits, now=later) == []
    # pinned to v1: main's revision goes, with the one blob only it links to
    done = collect_garbage(tmp_path, assigned=[kept], loaded=(), limits=limits, now=later)
    assert done == [Deletion(main, len(model_files["config.json"]), "Unassigned")]
    assert not paths[COMMIT_MAIN].exists()
    assert_same_files(paths[COMMIT_V1], v1)
    assert len(list((repo / "blobs").iterdir())) == len(model_files)
    assert collect_garbage(tmp_path, assigned=(), loaded=[kept], limits=limits, now=later) == []
    # nothing assigned: the last revision goes, and the repository with it
    done = collect_garbage(tmp_path, assigned=(), loaded=(), limits=limits, now=later)
    assert [d.name for d in done] == [kept] and done[0].bytes == sum(map(len, v1.values()))
    assert not repo.exists() and not list((tmp_path / "hf").glob("models--*"))


async def test_the_cap_covers_the_agents_hf_cache_and_collection_makes_room(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """The agent's own Hugging Face cache counts under --model-cache-max-bytes; a download
    beyond it first collects revisions no longer assigned (least recently used first), so
    the cache does not fill up for good."""
    from node_agent.fetch import cache_bytes
    from test_sources import COMMIT_MAIN

    need = sum(map(len, model_files.values()))
    limits = DownloadLimits(cache_max_bytes=need + need // 2)
    collected: list[Deletion] = []

    def make_room_for(repo_id: str):
        async def make_room(want: int, shortfall: int) -> None:
            collected.extend(await asyncio.to_thread(
                collect_garbage, tmp_path, assigned=[revision_name(repo_id, COMMIT_MAIN)],
                loaded=(), limits=limits, now=time.time(), need=want, shortfall=shortfall))
        return make_room

    async with serve_hub(ListingHub(model_files, COMMIT_MAIN)) as endpoint:
        first = await fetch(f"hf://hub-org/first@{COMMIT_MAIN}", tmp_path,
                            hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False,
                            limits=limits, make_room=make_room_for("hub-org/first"))
        assert cache_bytes(tmp_path) >= need
        second = await fetch(f"hf://hub-org/second@{COMMIT_MAIN}", tmp_path,
                             hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False,
                             limits=limits, make_room=make_room_for("hub-org/second"))
        assert [(d.name, d.reason) for d in collected] == [
            (revision_name("hub-org/first", COMMIT_MAIN), "SpaceNeeded")]
        assert not first.exists()
        assert_same_files(second, model_files)
        # with nothing to collect (the second is assigned), a third is refused for the cap
        with pytest.raises(SourceError) as e:
            await fetch(f"hf://hub-org/third@{COMMIT_MAIN}", tmp_path,
                        hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False,
                        limits=limits, make_room=make_room_for("hub-org/second"))
        assert e.value.reason == "InsufficientDisk" and "--model-cache-max-bytes" in (
            e.value.message)
    assert_same_files(second, model_files)


async def test_an_hf_commit_on_no_branch_or_tag_is_refused(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """The Hub serves a public repository's every commit by its hash, a pull request's too:
    a commit on no branch or tag (here only refs/pr/1's) is refused before any file body;
    one in main's history (not its head) is fetched."""
    from test_sources import COMMIT_MAIN, COMMIT_V1

    hub = ListingHub(model_files, COMMIT_V1)
    hub.hub.main, hub.hub.history = COMMIT_MAIN, [COMMIT_MAIN]  # V1 is only refs/pr/1's
    async with serve_hub(hub) as endpoint:
        with pytest.raises(SourceError) as e:
            await fetch(f"hf://hub-org/tiny@{COMMIT_V1}", tmp_path,
                        hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False)
        assert e.value.reason == "SourceRefused"
        assert e.value.message.startswith("refused by the source policy: ")
        assert f"commit {COMMIT_V1} is on no branch or tag" in e.value.message
        assert hub.bodies() == []
        hub.hub.history = [COMMIT_MAIN, COMMIT_V1]  # now merged: in main's history
        path = await fetch(f"hf://hub-org/tiny@{COMMIT_V1}", tmp_path,
                           hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False)
    assert_same_files(path, model_files)


async def test_an_agent_collects_an_unassigned_hf_revision_from_its_own_hf_cache(
        store, keys, core, tmp_path: Path, model_files: dict[str, bytes],  # noqa: F811
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the agent: an hf:// assignment is downloaded into <model cache>/hf (the
    agent's own Hugging Face cache), reported with its commit, and collected once
    unassigned."""
    from mlx_fleet.contract import AssignmentState
    from node_agent.controller import Controller
    from node_agent.registration import Registration
    from test_agent_controller import ADVERTISED, NODE, Capacity
    from test_sources import COMMIT_MAIN, https_assignment, report_events, settled

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub = ListingHub(model_files, COMMIT_MAIN)
    async with serve_hub(hub) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        reg = Registration(store, keys, node_name=NODE, address=ADVERTISED,
                           capacity=Capacity(), ttl=5)
        await reg.start()
        cache = tmp_path / "cache"
        ctl = Controller(store, keys, node_name=NODE, core=core, registration=reg,
                         advertise_url=ADVERTISED, model_cache=cache,
                         download_limits=DownloadLimits(unused_max_age_s=0),
                         source_policy=DEV_POLICY)
        await ctl.start()
        try:
            await asyncio.wait_for(ctl.cache_collected.wait(), 30)  # on start
            start = (await store.list(keys.root + "/")).revision + 1
            akey = keys.assignment(NODE, "default", "hub", "r1")
            await store.put(akey, https_assignment(
                "hub", f"hf://hub-org/tiny@{COMMIT_MAIN}").to_json())
            rkey = keys.report(NODE, "default", "hub", "r1")
            seen = await report_events(store, rkey, start, settled)
            assert seen[-1] is not None and seen[-1].state == AssignmentState.READY, seen[-1]
            assert seen[-1].digest == f"hf-commit:{COMMIT_MAIN}"
            snapshot = cache / "hf" / "models--hub-org--tiny" / "snapshots" / COMMIT_MAIN
            assert_same_files(snapshot, model_files)
            ctl.cache_collected.clear()
            await store.delete(akey)
            await report_events(store, rkey, start, lambda r: r is None)
            await asyncio.wait_for(ctl.cache_collected.wait(), 30)  # after the unassignment
            assert not snapshot.exists()
            assert not (cache / "hf" / "models--hub-org--tiny").exists()
            registry = core.metrics.registry
            assert registry.get_sample_value("mlxfleet_agent_model_cache_deleted_bytes_total",
                                             {"reason": "Unassigned"}) >= sum(
                map(len, model_files.values()))
        finally:
            await ctl.stop()
            for m in core.models():
                await core.unload_model(m.model_id, m.revision)
            await reg.stop()


async def test_an_unpinned_hf_download_fetches_the_commit_it_checked(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:  # noqa: F811
    """A branch that moves between the dry run (what was checked) and the download: the
    commit checked is the one fetched, and refs/main records it as huggingface_hub would."""
    from aiohttp import web

    from test_sources import COMMIT_MAIN, COMMIT_V1, UNPINNED

    hub = ListingHub(model_files, COMMIT_MAIN)
    answered = hub.hub.revision
    asked = []

    async def revision(request):  # main moves to V1 after the dry run resolved it
        rev = request.match_info["rev"]
        if len(rev) == 40:
            return web.json_response({"id": "hub-org/tiny", "sha": rev, "siblings": [
                {"rfilename": f} for f in model_files]})
        asked.append(rev)
        if len(asked) > 1:
            hub.hub.commit = COMMIT_V1
        return await answered(request)

    hub.hub.revision = revision
    async with serve_hub(hub) as endpoint:
        path = await fetch("hf://hub-org/tiny", tmp_path, hf_cache_dir=tmp_path / "hf",
                           hf_endpoint=endpoint, offline=False, limits=UNPINNED)
    assert path.name == COMMIT_MAIN
    assert_same_files(path, model_files)
    repo = tmp_path / "hf" / "models--hub-org--tiny"
    assert (repo / "refs" / "main").read_text() == COMMIT_MAIN
    assert [p.name for p in (repo / "snapshots").iterdir()] == [COMMIT_MAIN]
    again = await fetch("hf://hub-org/tiny@main", tmp_path, hf_cache_dir=tmp_path / "hf",
                        offline=True, limits=UNPINNED)
    assert again == path
