"""Bounded, verified, content-addressed downloads (issue 19, findings 3 and 4): every manifest
entry has a size and a sha256, the download fits the disk's reserve and the cache's cap before
its first byte, never takes a byte beyond the declared size, and the cache is
garbage-collected (``.part`` files and sources no longer assigned, least recently used first,
never what is assigned, loaded or downloading)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import namedtuple
from pathlib import Path

import pytest
from filelock import FileLock

from node_agent.fetch import (STATE_FILE, DownloadLimits, collect_garbage, digest_of,
                              mirror_dir)
from node_agent.fetch.bounds import (manifest_digest, parse_reserve, room_refusal,
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


# ---------------------------------------------------------------------------------------------
# garbage collection: the pure plan
# ---------------------------------------------------------------------------------------------

NOW = 1_000_000.0
HOUR = 3600.0


def entry(name: str, size: int, age: float, *, active: bool = False,
          parts: tuple[tuple[str, int, float], ...] = ()) -> CacheEntry:
    return CacheEntry(name, size, NOW - age, active,
                      tuple(PartFile(p, b, NOW - a) for p, b, a in parts))


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
        # the cap is the agent's own cache's (https:// downloads), not the Hugging Face one's
        path = await fetch(uri, tmp_path, hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint,
                           offline=False, disk_usage=disk(100 * GiB, 10 * GiB + need),
                           limits=DownloadLimits(cache_max_bytes=1))
    finally:
        await runner.cleanup()
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
