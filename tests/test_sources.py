"""Model sources: local directories (and what makes them unsafe), ``hf://`` from a populated
offline Hugging Face cache, ``https://`` mirrors served by a local TLS server the tests start
(progress, resumption after a dropped connection, verification, stalls, re-adoption), the
controller's Prefetching reports in the (in-memory) store, and the status progress bars."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from mlx_fleet.contract import (Assignment, AssignmentReport, AssignmentState, DownloadProgress,
                                Keys, ModelSource, NodeCapacity)
from mlx_fleet.fleetstatus import FleetView, render, summarize
from mlx_fleet.memstore import MemoryStore
from mlx_fleet.store import Store
from node_agent.controller import Controller
from mlx_fleet.source_policy import DEV_POLICY
from node_agent import fetch as fetching
from node_agent import sources
from node_agent.fetch import (STATE_FILE, DownloadLimits, digest_of, mirror_dir, parse_hf_uri,
                              parse_manifest)
from node_agent.fetch.bounds import manifest_digest
from node_agent.model_dir import SourceError, check_model_dir
from node_agent.registration import Registration
from node_agent.serving import ServingCore
from node_agent.sources import is_remote
from test_agent_controller import ADVERTISED, NODE, Capacity, assignment, core  # noqa: F401

TIMEOUT = 120  # a model load on two busy CPU cores

#: The source policy of these tests, explicitly: the mirrors run on 127.0.0.1 (a private
#: address) and the models lie in temporary directories, which the secure default refuses
#: (tests/test_source_policy.py and the policy tests below check that).
LOCAL = DEV_POLICY


def fetch(uri: str, dest_root: Path, **options):  # noqa: ANN201 - the coroutine of fetch()
    return fetching.fetch(uri, dest_root, **{"policy": LOCAL, **options})


def resolve_source(uri: str, **options) -> Path:
    return sources.resolve_source(uri, **{"policy": LOCAL, **options})


def reason_of(exc: pytest.ExceptionInfo[SourceError]) -> str:
    return exc.value.reason


# ---------------------------------------------------------------------------------------------
# a model mirror over HTTPS
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for ``localhost`` and ``mirror.example`` (a name the source
    policy tests resolve to loopback), ``(cert, key)``."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,DNS:mirror.example,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


class Mirror:
    """Serves ``files`` and a ``manifest.json`` under ``/models/tiny/`` over HTTPS, with Range
    support. Records every request as ``(name, Range header)``; can drop a file's connection
    once after N bytes (``cut_once``), stop sending a file after N bytes until ``unstall`` is
    set (``stall_at``), answer a file with a status (``status``), pace every file
    (``pace``: seconds per 16 KiB, a slow link), send a file with chunked transfer encoding
    (``chunked``: no Content-Length) and send N bytes more than the file (``extra``)."""

    CHUNK = 16 * 1024

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = dict(files)
        self.manifest: dict = {"files": [
            {"path": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
            for n, b in sorted(files.items())]}
        self.requests: list[tuple[str, str | None]] = []
        self.cut_once: dict[str, int] = {}
        self.stall_at: dict[str, int] = {}
        self.status: dict[str, int] = {}
        self.pace = 0.0
        self.chunked: set[str] = set()
        self.extra: dict[str, int] = {}
        self.sent: dict[str, int] = {}  # bytes of each file written to a client
        self.unstall = asyncio.Event()
        self.stalled = asyncio.Event()
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}/models/tiny/"

    @property
    def total(self) -> int:
        return sum(len(b) for b in self.files.values())

    def ranges(self, name: str) -> list[str | None]:
        return [r for n, r in self.requests if n == name]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        rng = request.headers.get("Range")
        self.requests.append((name, rng))
        if name in self.status:
            return web.Response(status=self.status[name], text="nope")
        body = (json.dumps(self.manifest).encode() if name == "manifest.json"
                else self.files.get(name))
        if body is None:
            return web.Response(status=404, text="not found")
        body += bytes(self.extra.get(name, 0))
        start, status, headers = 0, 200, {}
        if rng:
            m = re.fullmatch(r"bytes=(\d+)-", rng)
            assert m, rng
            start = int(m.group(1))
            if start >= len(body):
                return web.Response(status=416)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{len(body) - 1}/{len(body)}"
        resp = web.StreamResponse(status=status, headers=headers)
        if name in self.chunked:
            resp.enable_chunked_encoding()
        else:
            resp.content_length = len(body) - start
        await resp.prepare(request)
        end = len(body)
        cut = self.cut_once.pop(name, None)
        stall = self.stall_at.get(name) if not self.unstall.is_set() else None
        if cut is not None:
            end = cut
        elif stall is not None:
            end = stall
        pos = start
        while pos < end:
            await resp.write(body[pos:min(pos + self.CHUNK, end)])
            self.sent[name] = self.sent.get(name, 0) + min(self.CHUNK, end - pos)
            pos = min(pos + self.CHUNK, end)
            if self.pace:
                await asyncio.sleep(self.pace)  # a slow link
        if cut is not None:
            assert request.transport is not None
            request.transport.close()  # drop the connection mid-file
            return resp
        if stall is not None:
            self.stalled.set()
            await self.unstall.wait()  # no more bytes until the test releases the server
            return resp
        await resp.write_eof()
        return resp


@pytest.fixture
def model_files(test_model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(test_model_dir.iterdir()) if p.is_file()}


@pytest.fixture
async def mirror(tls: tuple[Path, Path], model_files: dict[str, bytes],
                 monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Mirror]:
    m = Mirror(model_files)
    app = web.Application()
    app.router.add_get("/models/tiny/{name:.+}", m.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*tls)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    m.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    monkeypatch.setenv("SSL_CERT_FILE", str(tls[0]))  # trust the test CA (read per fetch)
    yield m
    m.unstall.set()
    await runner.cleanup()


def assert_same_files(model_dir: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (model_dir / name).read_bytes() == data, name
    assert not list(model_dir.rglob("*.part"))


# ---------------------------------------------------------------------------------------------
# https:// mirrors
# ---------------------------------------------------------------------------------------------


async def test_download_reports_progress_and_verifies(mirror: Mirror, tmp_path: Path,
                                                      model_files: dict[str, bytes]) -> None:
    seen: list[DownloadProgress] = []
    path = await fetch(mirror.url, tmp_path, progress=seen.append, progress_interval_s=0,
                       chunk_bytes=64 * 1024)
    assert path == mirror_dir(mirror.url, tmp_path) and path.parent == tmp_path / "https"
    assert_same_files(path, model_files)
    assert len(seen) >= 2
    assert [p.bytes_total for p in seen] == [mirror.total] * len(seen)
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and done[0] == 0 and done[-1] == mirror.total
    assert any(0 < d < mirror.total for d in done)  # progress within the download
    assert (seen[-1].files_done, seen[-1].files_total) == (len(model_files), len(model_files))
    assert seen[-1].eta_seconds == 0 and seen[-1].rate_bytes_per_second > 0
    # config.json comes first (checked before any weights are fetched); each file once
    assert mirror.requests[:2] == [("manifest.json", None), ("config.json", None)]
    assert sorted(n for n, _ in mirror.requests[1:]) == sorted(model_files)


async def test_progress_callbacks_are_rate_bounded(mirror: Mirror, tmp_path: Path) -> None:
    mirror.pace = 0.01  # ~1.6 MB/s: the 600 kB download takes about 0.4 s
    stamps: list[tuple[float, DownloadProgress]] = []
    await fetch(mirror.url, tmp_path, progress=lambda p: stamps.append((time.monotonic(), p)),
                progress_interval_s=0.1)
    assert len(stamps) >= 3
    gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    assert min(gaps[:-1]) >= 0.1  # the last one (complete) is sent at once
    middle = [p for _, p in stamps[1:-1]]
    assert any(p.rate_bytes_per_second > 0 and p.eta_seconds is not None for p in middle)


async def test_dropped_connection_resumes_with_a_range_request(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    cut = 200_000
    mirror.cut_once["model.safetensors"] = cut
    path = await fetch(mirror.url, tmp_path)
    ranges = mirror.ranges("model.safetensors")
    assert ranges[0] is None and len(ranges) == 2
    m = re.fullmatch(r"bytes=(\d+)-", ranges[1] or "")
    assert m is not None, ranges
    resumed = int(m.group(1))
    assert 0 < resumed <= cut
    assert_same_files(path, model_files)  # sha256 and size verified over both parts


async def test_corrupt_file_fails_clearly_and_is_fetched_again(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    good = mirror.files["tokenizer.json"]
    mirror.files["tokenizer.json"] = good[:-1] + bytes([good[-1] ^ 1])  # same size, one bit off
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert reason_of(e) == "DownloadCorrupt"
    assert "tokenizer.json" in e.value.message and "sha256" in e.value.message
    target = mirror_dir(mirror.url, tmp_path)
    assert not (target / "tokenizer.json").exists()
    assert not (target / "tokenizer.json.part").exists()

    mirror.files["tokenizer.json"] = good
    mirror.requests.clear()
    path = await fetch(mirror.url, tmp_path)
    assert_same_files(path, model_files)
    # files verified before the failure are kept
    fetched = {n for n, _ in mirror.requests} - {"manifest.json"}
    assert "tokenizer.json" in fetched and "config.json" not in fetched


async def test_wrong_size_is_refused(mirror: Mirror, tmp_path: Path) -> None:
    entry = next(f for f in mirror.manifest["files"] if f["path"] == "tokenizer_config.json")
    entry["size"] += 10
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert reason_of(e) == "DownloadCorrupt"
    assert "tokenizer_config.json" in e.value.message
    assert f"{entry['size'] - 10} bytes, the manifest says {entry['size']}" in e.value.message


async def test_stalled_server_fails_within_the_timeout_then_resumes(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    at = 100_000
    mirror.stall_at["model.safetensors"] = at
    t0 = time.monotonic()
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path, stall_timeout_s=0.3)
    elapsed = time.monotonic() - t0
    assert reason_of(e) == "DownloadStalled"
    assert "model.safetensors" in e.value.message and "0.3s" in e.value.message
    assert f"{at} of {len(model_files['model.safetensors'])} bytes" in e.value.message
    assert 0.3 <= elapsed < 5

    mirror.unstall.set()
    path = await fetch(mirror.url, tmp_path)
    assert mirror.ranges("model.safetensors")[-1] == f"bytes={at}-"
    assert_same_files(path, model_files)


async def test_a_download_is_cancellable(mirror: Mirror, tmp_path: Path,
                                         model_files: dict[str, bytes]) -> None:
    mirror.stall_at["model.safetensors"] = 50_000
    task = asyncio.ensure_future(fetch(mirror.url, tmp_path, stall_timeout_s=600))
    await asyncio.wait_for(mirror.stalled.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    # the lock is free again and the partial file resumes
    mirror.unstall.set()
    path = await asyncio.wait_for(fetch(mirror.url, tmp_path), 30)
    assert mirror.ranges("model.safetensors")[-1] == "bytes=50000-"
    assert_same_files(path, model_files)


async def test_completed_download_is_adopted_without_the_server(
        mirror: Mirror, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    first = await fetch(mirror.url, tmp_path)
    state = json.loads((first / STATE_FILE).read_text())
    assert state["complete"] is True and state["uri"] == mirror.url
    mirror.requests.clear()
    seen: list[DownloadProgress] = []
    # a new call, as after an agent restart; the URI may name the manifest itself
    again = await fetch(mirror.url + "manifest.json", tmp_path, progress=seen.append)
    assert again == first and mirror.requests == []
    assert seen and seen[-1].bytes_done == seen[-1].bytes_total == mirror.total
    assert seen[-1].files_done == len(model_files)

    # a file lost from disk: the download is no longer complete, only that file is fetched
    (first / "tokenizer.json").unlink()
    await fetch(mirror.url, tmp_path)
    assert [n for n, _ in mirror.requests] == ["manifest.json", "tokenizer.json"]


async def test_concurrent_fetches_of_one_uri_download_once(mirror: Mirror, tmp_path: Path) -> None:
    mirror.pace = 0.002
    a, b = await asyncio.gather(fetch(mirror.url, tmp_path), fetch(mirror.url, tmp_path))
    assert a == b
    assert len(mirror.ranges("model.safetensors")) == 1
    assert len(mirror.ranges("manifest.json")) == 1


async def test_mirror_errors_have_reasons(mirror: Mirror, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url.replace("/tiny/", "/absent/"), tmp_path)
    assert reason_of(e) == "ModelNotFound" and "manifest.json" in e.value.message

    mirror.status["tokenizer.json"] = 503
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path)
    assert reason_of(e) == "DownloadFailed" and "HTTP 503" in e.value.message
    del mirror.status["tokenizer.json"]

    # an unsafe manifest is refused before anything is fetched or written
    mirror.manifest["files"].append({"path": "../escape.json", "size": 1})
    mirror.requests.clear()
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path / "other")
    assert reason_of(e) == "InvalidSource" and "../escape.json" in e.value.message
    assert [n for n, _ in mirror.requests] == ["manifest.json"]
    assert not (tmp_path / "other" / "https" / "escape.json").exists()
    mirror.manifest["files"].pop()

    # a certificate nobody vouches for
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-ca.pem"))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
    with pytest.raises(SourceError) as e:
        await fetch(mirror.url, tmp_path / "untrusted")
    assert reason_of(e) == "DownloadFailed" and "certificate" in e.value.message.lower()


def test_manifest_format() -> None:
    digest = "ab" * 32
    entries = parse_manifest(json.dumps({"files": [
        {"path": "weights/model.safetensors", "size": 3, "sha256": digest.upper()},
        {"path": "config.json", "size": 2, "sha256": digest}]}))
    assert [(e.path, e.size, e.sha256) for e in entries] == [
        ("config.json", 2, digest), ("weights/model.safetensors", 3, digest)]
    ok = {"size": 1, "sha256": digest}
    bad = [
        [], {"files": []}, {"files": [{"path": "model.safetensors", **ok}]},  # no config.json
        {"files": [{"path": "config.json", **ok}, {"path": "/etc/passwd", **ok}]},
        {"files": [{"path": "config.json", **ok}, {"path": "a/../../b", **ok}]},
        {"files": [{"path": "config.json", **ok}, {"path": "a\\b", **ok}]},
        {"files": [{"path": "config.json", **ok}, {"path": "a//b", **ok}]},
        {"files": [{"path": "config.json", **ok}, {"path": "config.json", **ok}]},
        {"files": [{"path": "config.json", **ok}, {"path": "a", **ok}, {"path": "a/b", **ok}]},
        {"files": [{"path": "config.json", "size": -1, "sha256": digest}]},
        {"files": [{"path": "config.json", "size": True, "sha256": digest}]},
        {"files": [{"path": "config.json", "size": 1, "sha256": "xyz"}]},
        {"files": [{"path": "config.json"}]},                                  # neither
        {"files": [{"path": "config.json", "sha256": digest}]},                # no size
        {"files": [{"path": "config.json", "size": 1}]},                       # no sha256
    ]
    for manifest in bad:
        with pytest.raises(SourceError) as e:
            parse_manifest(json.dumps(manifest))
        assert reason_of(e) == "InvalidSource", manifest
    with pytest.raises(SourceError):
        parse_manifest(b"{not json")


def test_uri_checks() -> None:
    assert is_remote("hf://a/b") and is_remote("https://h/m/") and not is_remote("/models/m")
    assert parse_hf_uri("hf://org/repo") == ("org/repo", None)
    assert parse_hf_uri("hf://org/repo@refs/pr/1") == ("org/repo", "refs/pr/1")
    for uri in ["hf://org", "hf://org/repo/extra", "hf://org/../x", "hf://org/re--po",
                "hf://org/repo@", "hf://org/repo@a/../b"]:
        with pytest.raises(SourceError) as e:
            parse_hf_uri(uri)
        assert reason_of(e) == "InvalidSource", uri
    for uri in ["https://user:pw@host/m/", "https://host/m/?token=1", "https://host/a/../b/"]:
        with pytest.raises(SourceError) as e:
            resolve_source(uri)
        assert reason_of(e) == "InvalidSource", uri
    with pytest.raises(SourceError) as e:
        resolve_source("http://mirror.example/models/m/")
    assert reason_of(e) == "UnsupportedSource" and "http://" in e.value.message
    assert "TLS" in e.value.message


# ---------------------------------------------------------------------------------------------
# local directories
# ---------------------------------------------------------------------------------------------


def small_model(root: Path, name: str = "m") -> Path:
    model = root / name
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    return model


def test_local_sources_and_what_is_refused(tmp_path: Path) -> None:
    model = small_model(tmp_path)
    assert resolve_source(str(model)) == model
    assert resolve_source(f"file://{model}") == model
    assert resolve_source(f"file://localhost{model}") == model
    # symlinks that stay inside the model are fine (also a link to the model directory)
    (model / "sub").mkdir()
    (model / "alias.safetensors").symlink_to(model / "model.safetensors")
    (model / "sub" / "up.json").symlink_to("../config.json")
    link = tmp_path / "current"
    link.symlink_to(model, target_is_directory=True)
    assert resolve_source(str(link)) == link

    cases = {
        "relative/path": "InvalidSource",
        "": "InvalidSource",
        "file://host/abs": "InvalidSource",
        f"{model}/../m": "InvalidSource",
        "s3://bucket/m": "UnsupportedSource",
        str(tmp_path / "missing"): "ModelNotFound",
        str(tmp_path): "ModelNotFound",  # exists, but no config.json
    }
    for uri, reason in cases.items():
        with pytest.raises(SourceError) as e:
            resolve_source(uri)
        assert reason_of(e) == reason, uri
        assert e.value.message


@pytest.mark.parametrize("make", ["file", "dir", "dangling", "config", "fifo"])
def test_symlinks_out_of_the_model_are_refused(tmp_path: Path, make: str) -> None:
    model = small_model(tmp_path)
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "tokenizer.json").write_text("{}")
    if make == "file":
        (model / "tokenizer.json").symlink_to(secret / "tokenizer.json")
    elif make == "dir":
        (model / "extra").symlink_to(secret, target_is_directory=True)
    elif make == "dangling":
        (model / "tokenizer.json").symlink_to(model / "nothing")
    elif make == "config":
        (model / "config.json").unlink()
        (secret / "config.json").write_text("{}")
        (model / "config.json").symlink_to(secret / "config.json")
    else:
        os.mkfifo(model / "tokenizer.json")
    with pytest.raises(SourceError) as e:
        resolve_source(str(model))
    assert reason_of(e) == "InvalidSource"
    assert str(model) in e.value.message
    if make in ("file", "dir", "config"):
        assert "outside the model root" in e.value.message and str(secret) in e.value.message


@pytest.mark.parametrize("config, words", [
    ("[1, 2]", "not a JSON object"), ("{oops", "not valid JSON"),
    ('{"model_type": "x", "model_file": "custom.py"}', "trust_remote_code")])
def test_bad_config_is_refused(tmp_path: Path, config: str, words: str) -> None:
    model = small_model(tmp_path)
    (model / "config.json").write_text(config)
    with pytest.raises(SourceError) as e:
        resolve_source(f"file://{model}")
    assert reason_of(e) == "InvalidSource" and words in e.value.message


@pytest.mark.parametrize("where, content, words", [
    ("config.json", {"model_type": "x", "auto_map": {"AutoModel": "modeling_x.X"}},
     "config.json asks for custom code (auto_map)"),
    ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["tok_x.T", None]}},
     "tokenizer_config.json asks for custom code (auto_map)"),
    ("modeling_x.py", "import os\n", "modeling_x.py in"),
    ("sub/tokenization_x.pyc", b"\x00", "tokenization_x.pyc in")])
def test_model_dir_with_code_is_refused(tmp_path: Path, where: str, content, words: str) -> None:
    """Issue 19 (finding 11): a model directory holds no code — no ``*.py``, no ``auto_map`` —
    whatever transformers would do with it (trust_remote_code is never enabled)."""
    model = small_model(tmp_path)
    check_model_dir(model)  # fine before
    target = model / where
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, dict):
        base = json.loads(target.read_text()) if target.exists() else {}
        target.write_text(json.dumps({**base, **content}))
    elif isinstance(content, bytes):
        target.write_bytes(content)
    else:
        target.write_text(content)
    with pytest.raises(SourceError) as e:
        resolve_source(f"file://{model}")
    assert reason_of(e) == "InvalidSource" and words in e.value.message
    assert "trust_remote_code" in e.value.message


def test_tokenizer_loads_with_trust_remote_code_false(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 19 (finding 11): ``trust_remote_code=False`` is passed, not left to transformers'
    interactive prompt."""
    import transformers

    from mlx_fleet.testmodel import make_test_model
    from node_agent.serving.loading import load_tokenizer

    seen: list[dict] = []
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(spy))
    load_tokenizer(make_test_model(tmp_path / "tiny", seed=0))
    assert seen and all(k.get("trust_remote_code") is False for k in seen), seen


# ---------------------------------------------------------------------------------------------
# hf:// from a populated offline cache
# ---------------------------------------------------------------------------------------------

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def populate_hub_cache(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], *,
                       refs: tuple[str, ...] = ()) -> Path:
    """Write ``files`` as ``repo_id`` at ``commit`` in huggingface_hub's cache layout:
    ``models--<org>--<name>/blobs/<sha256>``, ``snapshots/<commit>/<file>`` → ``../../blobs/…``,
    ``refs/<ref>`` holding the commit hash. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    for ref in refs:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, model_files: dict[str, bytes],
              monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network: read at call time
    cache = tmp_path / "hf"
    populate_hub_cache(cache, "test-org/tiny", COMMIT_MAIN, model_files, refs=("main",))
    v1 = dict(model_files)
    v1["config.json"] = json.dumps({**json.loads(model_files["config.json"]),
                                    "mlx_fleet_test": "v1"}).encode()
    populate_hub_cache(cache, "test-org/tiny", COMMIT_V1, v1, refs=("v1",))
    return cache


#: ``hf://`` sources that follow a branch or tag need the agent's opt-out.
UNPINNED = DownloadLimits(allow_unpinned_hub=True)


async def test_hf_source_resolves_from_the_offline_cache(
        hub_cache: Path, tmp_path: Path, model_files: dict[str, bytes]) -> None:
    seen: list[DownloadProgress] = []
    path = await fetch("hf://test-org/tiny", tmp_path, hf_cache_dir=hub_cache,
                       progress=seen.append, limits=UNPINNED)
    assert path == hub_cache / "models--test-org--tiny" / "snapshots" / COMMIT_MAIN
    assert digest_of(path) == f"hf-commit:{COMMIT_MAIN}"  # the commit main resolved to
    for name, data in model_files.items():
        assert (path / name).read_bytes() == data
    assert seen[-1].files_done == seen[-1].files_total == len(model_files)
    assert seen[-1].bytes_done == seen[-1].bytes_total == sum(map(len, model_files.values()))

    for revision in ("v1", COMMIT_V1):
        path = await fetch(f"hf://test-org/tiny@{revision}", tmp_path, hf_cache_dir=hub_cache,
                           limits=UNPINNED)
        assert path.name == COMMIT_V1
        assert json.loads((path / "config.json").read_text())["mlx_fleet_test"] == "v1"
    # the synchronous entry point, from a thread; a pinned commit needs no opt-out
    path = await asyncio.to_thread(resolve_source, f"hf://test-org/tiny@{COMMIT_V1}",
                                   hf_cache_dir=hub_cache)
    assert path.name == COMMIT_V1


async def test_hf_source_must_pin_a_commit(hub_cache: Path, tmp_path: Path) -> None:
    """A branch or tag can move under the same URI (two Macs serving one revision would hold
    different weights): refused before anything is read, unless the agent opts out."""
    for uri in ("hf://test-org/tiny", "hf://test-org/tiny@main", "hf://test-org/tiny@v1",
                f"hf://test-org/tiny@{COMMIT_V1[:12]}", f"hf://test-org/tiny@{COMMIT_V1.upper()}"):
        with pytest.raises(SourceError) as e:
            await fetch(uri, tmp_path, hf_cache_dir=hub_cache)
        assert reason_of(e) == "InvalidSource", uri
        assert "must pin a commit" in e.value.message
        assert "--allow-unpinned-hub-revisions" in e.value.message
    path = await fetch(f"hf://test-org/tiny@{COMMIT_V1}", tmp_path, hf_cache_dir=hub_cache)
    assert digest_of(path) == f"hf-commit:{COMMIT_V1}"


async def test_hf_missing_repo_or_revision_is_model_not_found(hub_cache: Path,
                                                              tmp_path: Path) -> None:
    for uri in ("hf://test-org/absent", "hf://test-org/tiny@v9", f"hf://test-org/tiny@{'c' * 40}"):
        with pytest.raises(SourceError) as e:
            await fetch(uri, tmp_path, hf_cache_dir=hub_cache, limits=UNPINNED)
        assert reason_of(e) == "ModelNotFound", uri
        assert "test-org/" in e.value.message and "offline" in e.value.message


async def test_hf_snapshot_linking_out_of_the_repository_is_refused(
        hub_cache: Path, tmp_path: Path) -> None:
    snapshot = hub_cache / "models--test-org--tiny" / "snapshots" / COMMIT_MAIN
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (snapshot / "tokenizer.json").unlink()
    (snapshot / "tokenizer.json").symlink_to(outside)
    with pytest.raises(SourceError) as e:
        await fetch(f"hf://test-org/tiny@{COMMIT_MAIN}", tmp_path, hf_cache_dir=hub_cache)
    assert reason_of(e) == "InvalidSource" and str(outside) in e.value.message


class FakeHub:
    """The part of the Hugging Face Hub API that ``snapshot_download`` uses (revision info, the
    file tree, ``resolve`` with ``X-Repo-Commit``/``ETag``), and ``list_repo_refs`` /
    ``list_repo_commits`` (``main`` and a pull request), for one repository at one commit.
    Records ``(method, file)`` of every file request; paces file bodies like a slow link."""

    def __init__(self, files: dict[str, bytes], commit: str) -> None:
        self.files, self.commit = files, commit
        self.requests: list[tuple[str, str]] = []
        #: The ``main`` branch's head and history (commits reachable from a branch); the
        #: served commit unless a test makes it a pull request's only.
        self.main = commit
        self.history = [commit]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self.revision)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self.tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{file}", self.resolve)
        app.router.add_get("/api/models/{org}/{name}/refs", self.refs)
        app.router.add_get("/api/models/{org}/{name}/commits/{rev:.+}", self.commits)
        return app

    async def refs(self, request: web.Request) -> web.Response:
        """``main`` at :attr:`main` (default: the served commit); ``refs/pr/1`` at the served
        commit."""
        def ref(kind: str, name: str, commit: str) -> dict:
            return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": commit}

        return web.json_response({"branches": [ref("heads", "main", self.main)], "tags": [],
                                  "converts": [],
                                  "pullRequests": [ref("pr", "1", self.commit)]})

    async def commits(self, request: web.Request) -> web.Response:
        """``main``'s history: :attr:`history` (default: the served commit)."""
        if request.match_info["rev"] not in ("main", "refs/heads/main"):
            return web.json_response({"error": "Revision Not Found"}, status=404,
                                     headers={"X-Error-Code": "RevisionNotFound"})
        return web.json_response([
            {"id": c, "authors": [{"user": "test-org"}], "date": "2026-01-01T00:00:00.000Z",
             "title": "a commit", "message": ""} for c in self.history])

    async def revision(self, request: web.Request) -> web.Response:
        return web.json_response({"id": "hub-org/tiny", "sha": self.commit,
                                  "siblings": [{"rfilename": f} for f in self.files]})

    async def tree(self, request: web.Request) -> web.Response:
        return web.json_response([{"type": "file", "path": f, "size": len(b),
                                   "oid": hashlib.sha1(b).hexdigest()}
                                  for f, b in self.files.items()])

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        self.requests.append((request.method, name))
        body = self.files[name]
        headers = {"X-Repo-Commit": self.commit,
                   "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
        if request.method == "HEAD":
            return web.Response(headers={**headers, "Content-Length": str(len(body))})
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        for i in range(0, len(body), 64 * 1024):
            await resp.write(body[i:i + 64 * 1024])
            await asyncio.sleep(0.01)  # a slow link
        await resp.write_eof()
        return resp


async def test_hf_download_through_huggingface_hub_then_offline(
        tmp_path: Path, model_files: dict[str, bytes]) -> None:
    hub = FakeHub({**model_files, "modeling_custom.py": b"raise SystemExit"}, COMMIT_MAIN)
    runner = web.AppRunner(hub.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    endpoint = f"http://127.0.0.1:{port}"
    try:
        seen: list[DownloadProgress] = []
        path = await fetch(f"hf://hub-org/tiny@{COMMIT_MAIN}", tmp_path,
                           hf_cache_dir=tmp_path / "hf", hf_endpoint=endpoint, offline=False,
                           progress=seen.append, progress_interval_s=0.05)
    finally:
        await runner.cleanup()
    assert path == tmp_path / "hf" / "models--hub-org--tiny" / "snapshots" / COMMIT_MAIN
    for name, data in model_files.items():
        assert (path / name).read_bytes() == data
    # custom code is never fetched
    assert not (path / "modeling_custom.py").exists()
    assert "modeling_custom.py" not in {n for _, n in hub.requests}
    assert len(seen) >= 2
    total = sum(map(len, model_files.values()))
    assert seen[-1].bytes_done == seen[-1].bytes_total == total
    assert seen[-1].files_done == seen[-1].files_total == len(model_files)
    done = [p.bytes_done for p in seen]
    assert done == sorted(done)

    # the hub is gone: offline, the cached snapshot is used as it is
    again = await fetch(f"hf://hub-org/tiny@{COMMIT_MAIN}", tmp_path,
                        hf_cache_dir=tmp_path / "hf", offline=True)
    assert again == path


def test_check_model_dir_root(tmp_path: Path) -> None:
    """A snapshot's links into the repository's blobs are inside the root it is given."""
    snapshot = populate_hub_cache(tmp_path, "o/r", COMMIT_MAIN, {"config.json": b"{}"})
    check_model_dir(snapshot, root=snapshot.parent.parent)
    with pytest.raises(SourceError):
        check_model_dir(snapshot)  # the blobs are outside the snapshot itself


# ---------------------------------------------------------------------------------------------
# the controller: Prefetching → Loading → Ready
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(memory_store: MemoryStore) -> MemoryStore:
    """The store of every test here: the in-memory one (nothing here is about etcd)."""
    return memory_store


@pytest.fixture
async def controller(store: Store, keys: Keys, core: ServingCore,
                     tmp_path: Path) -> AsyncIterator[Controller]:
    reg = Registration(store, keys, node_name=NODE, address=ADVERTISED, capacity=Capacity(),
                       ttl=5)
    await reg.start()
    ctl = Controller(store, keys, node_name=NODE, core=core, registration=reg,
                     advertise_url=ADVERTISED, model_cache=tmp_path / "cache",
                     source_policy=LOCAL)
    await ctl.start()
    yield ctl
    await ctl.stop()
    for m in core.models():
        await core.unload_model(m.model_id, m.revision)
    await reg.stop()


def https_assignment(name: str, uri: str, generation: int = 1) -> Assignment:
    return Assignment(namespace="default", name=name, generation=generation,
                      served_model_name=name, source=ModelSource(uri=uri, revision="r1"),
                      memory_bytes=2**20)


async def report_events(store: Store, key: str, start: int,
                        until: Callable[[AssignmentReport | None], bool]
                        ) -> list[AssignmentReport | None]:
    """Reports written to ``key`` from revision ``start`` (None = deleted), up to and including
    the first one satisfying ``until``."""
    seen: list[AssignmentReport | None] = []

    async def collect() -> None:
        async for ev in store.watch(key, start):
            if ev.kv.key != key:
                continue
            seen.append(AssignmentReport.from_json(ev.kv.value) if ev.type == "PUT" else None)
            if until(seen[-1]):
                return

    await asyncio.wait_for(collect(), TIMEOUT)
    return seen


def settled(r: AssignmentReport | None) -> bool:
    return r is not None and r.state in (AssignmentState.READY, AssignmentState.FAILED)


async def test_https_assignment_prefetches_with_progress_then_serves(
        store: Store, keys: Keys, core: ServingCore, controller: Controller,
        mirror: Mirror) -> None:
    mirror.pace = 0.02  # about 0.8 s for the weights: progress reports while it downloads
    rkey = keys.report(NODE, "default", "remote", "r1")
    start = (await store.list(keys.root + "/")).revision + 1
    a = https_assignment("remote", mirror.url)
    await store.put(keys.assignment(NODE, "default", "remote", "r1"), a.to_json())

    seen = await report_events(store, rkey, start, settled)
    states = [r.state for r in seen if r]
    n = states.count(AssignmentState.PREFETCHING)
    assert n >= 3 and states == [AssignmentState.PREFETCHING] * n + [
        AssignmentState.LOADING, AssignmentState.READY], states
    prefetching = [r.progress for r in seen[:n] if r]
    assert all(p is not None for p in prefetching)
    done = [p.bytes_done for p in prefetching]  # type: ignore[union-attr]
    assert done == sorted(done) and any(0 < d < mirror.total for d in done)
    last = prefetching[-1]
    assert last is not None and last.bytes_done == last.bytes_total == mirror.total
    assert last.files_done == last.files_total == len(mirror.files)
    assert any(p.rate_bytes_per_second > 0 for p in prefetching[1:-1])  # type: ignore[union-attr]
    ready = seen[-1]
    assert ready is not None and ready.endpoint == ADVERTISED and ready.resident_bytes > 0
    assert seen[n] is not None and seen[n].progress is None  # Loading carries no download
    # what was loaded, content-addressed: the digest of the manifest's (path, sha256) list
    digest = manifest_digest((f["path"], f["sha256"]) for f in mirror.manifest["files"])
    assert seen[n].digest == ready.digest == digest  # type: ignore[union-attr]
    assert all(r.digest == "" for r in seen[:n] if r)  # not known while downloading

    gen = await core.generate("remote", revision="r1", prompt="Hello, world!", max_tokens=4,
                              temperature=0.0)
    async with gen:
        chunks = [c.text async for c in gen]
    assert gen.completion_tokens == 4 and len(chunks) >= 1
    assert controller.states()["default/remote/r1"]["state"] == "Ready"


async def test_download_stops_when_the_assignment_goes_away(
        store: Store, keys: Keys, core: ServingCore, controller: Controller,
        mirror: Mirror) -> None:
    mirror.stall_at["model.safetensors"] = 50_000
    rkey = keys.report(NODE, "default", "gone", "r1")
    start = (await store.list(keys.root + "/")).revision + 1
    akey = keys.assignment(NODE, "default", "gone", "r1")
    await store.put(akey, https_assignment("gone", mirror.url).to_json())
    await asyncio.wait_for(mirror.stalled.wait(), TIMEOUT)
    await store.delete(akey)
    seen = await report_events(store, rkey, start, lambda r: r is None)
    assert {r.state for r in seen if r} == {AssignmentState.PREFETCHING}
    # another assignment loads (from the same, now quick, mirror), resuming the partial file
    mirror.unstall.set()
    await store.put(keys.assignment(NODE, "default", "next", "r1"),
                    https_assignment("next", mirror.url).to_json())
    seen = await report_events(store, keys.report(NODE, "default", "next", "r1"), start, settled)
    assert seen[-1] is not None and seen[-1].state == AssignmentState.READY
    assert mirror.ranges("model.safetensors")[-1] == "bytes=50000-"  # resumed, not restarted


async def test_a_stalled_download_never_blocks_another_assignment(
        store: Store, keys: Keys, core: ServingCore, controller: Controller,
        mirror: Mirror, test_model_dir: Path) -> None:
    """Issue 6 §3, "the agent converges assignments concurrently": while assignment A's
    download is held by the server, assignment B (a local directory) loads and is Ready;
    unassigning A while it downloads retires it without waiting for the server (nothing of A
    was ever Loading or Ready, nothing of it is resident); re-assigned once the server lets go,
    A resumes its download and is Ready."""
    mirror.stall_at["model.safetensors"] = 50_000
    akey = keys.assignment(NODE, "default", "slow", "r1")
    arep = keys.report(NODE, "default", "slow", "r1")
    start = (await store.list(keys.root + "/")).revision + 1
    await store.put(akey, https_assignment("slow", mirror.url).to_json())
    await asyncio.wait_for(mirror.stalled.wait(), TIMEOUT)  # A's body is held from here on

    b = assignment("local", test_model_dir)
    await store.put(keys.assignment(NODE, "default", "local", "r1"), b.to_json())
    seen_b = await report_events(store, keys.report(NODE, "default", "local", "r1"), start,
                                 settled)
    assert seen_b[-1] is not None and seen_b[-1].state == AssignmentState.READY
    assert not mirror.unstall.is_set()  # B came up while A's download was still held
    a_now = AssignmentReport.from_json((await store.get(arep)).value)  # type: ignore[union-attr]
    assert a_now.state == AssignmentState.PREFETCHING
    assert core.is_loaded("local", "r1") and not core.is_loaded("slow")

    await store.delete(akey)  # unassigned mid-download, the server still holding the body
    seen_a = await report_events(store, arep, start, lambda r: r is None)
    assert {r.state for r in seen_a if r} == {AssignmentState.PREFETCHING}
    await controller.converged()
    assert not core.is_loaded("slow") and set(controller.served()) == {"local"}
    assert "default/slow/r1" not in controller.states()
    assert core.registry.get_sample_value("mlxfleet_agent_download_bytes_total",
                                          {"model": "slow", "revision": "r1"}) is None

    mirror.unstall.set()  # the server lets go; A is assigned again
    start = (await store.list(keys.root + "/")).revision + 1
    await store.put(akey, https_assignment("slow", mirror.url, generation=2).to_json())
    seen_a = await report_events(store, arep, start, settled)
    assert seen_a[-1] is not None and seen_a[-1].state == AssignmentState.READY
    assert seen_a[-1].generation == 2 and seen_a[-1].estimated_bytes > 0
    assert mirror.ranges("model.safetensors")[-1] == "bytes=50000-"  # resumed, not restarted
    assert core.is_loaded("slow", "r1") and core.is_loaded("local", "r1")


async def test_a_changed_source_restarts_a_held_download(
        store: Store, keys: Keys, core: ServingCore, controller: Controller,
        mirror: Mirror, test_model_dir: Path) -> None:
    """An assignment whose source changes while its download is held by the server: the
    download is called off and the new source (a local directory) loads and is Ready, the
    server still holding the old body."""
    mirror.stall_at["model.safetensors"] = 50_000
    akey = keys.assignment(NODE, "default", "moved", "r1")
    rkey = keys.report(NODE, "default", "moved", "r1")
    await store.put(akey, https_assignment("moved", mirror.url).to_json())
    await asyncio.wait_for(mirror.stalled.wait(), TIMEOUT)
    start = (await store.list(keys.root + "/")).revision + 1
    await store.put(akey, assignment("moved", test_model_dir, generation=2).to_json())
    seen = await report_events(store, rkey, start, settled)
    assert seen[-1] is not None and seen[-1].state == AssignmentState.READY
    assert seen[-1].generation == 2 and str(test_model_dir) in seen[-1].message
    assert all(r is not None and r.generation == 2 for r in seen)  # nothing more of the old
    assert not mirror.unstall.is_set()
    assert [(m.model_id, m.path) for m in core.models()] == [("moved", str(test_model_dir))]


# ---------------------------------------------------------------------------------------------
# mlx-fleet status
# ---------------------------------------------------------------------------------------------


def test_status_shows_a_progress_bar_for_prefetching_rows() -> None:
    from rich.console import Console

    from mlx_fleet.contract import NodeRecord

    p = DownloadProgress(bytes_done=12 * 2**20, bytes_total=48 * 2**20,
                         rate_bytes_per_second=3 * 2**20, eta_seconds=12, files_done=1,
                         files_total=3)
    assert p.text() == "12.0MiB / 48.0MiB · 3.0MiB/s · ETA 0:00:12 · 1/3 files"
    assert DownloadProgress().text() == "0B / ? · 0B/s · ETA -"
    node = NodeRecord(name="mac-a", address="http://mac-a:8000", capacity=NodeCapacity(
        memory_total_bytes=64 << 30, memory_available_bytes=32 << 30, chip="Apple M3 Max",
        chip_generation=3))
    refs = [("mac-a", "default", name, "r1") for name in ("down", "up")]
    view = FleetView(
        nodes={"mac-a": node},
        assignments={ref: https_assignment(ref[2], "https://m.example/x/") for ref in refs},
        reports={refs[0]: AssignmentReport(node="mac-a", namespace="default", name="down",
                                           revision="r1", state=AssignmentState.PREFETCHING,
                                           reason="FetchingModel", progress=p),
                 refs[1]: AssignmentReport(node="mac-a", namespace="default", name="up",
                                           revision="r1", state=AssignmentState.READY,
                                           progress=p)})
    rows = {r["deployment"]: r["progress"] for r in summarize(view)}
    assert rows == {"default/down": p.text(), "default/up": "-"}
    console = Console(record=True, width=250, color_system=None)
    render(view, console)
    out = console.export_text()
    assert "Progress" in out and "3.0MiB/s" in out and "ETA 0:00:12" in out
    assert "━" in out  # the bar

    console = Console(record=True, width=250, color_system=None)
    render(FleetView(nodes={"mac-a": node}, assignments={}, reports={}), console)
    assert "Progress" not in console.export_text()  # the column only while downloading



async def test_a_hostile_safetensors_header_is_refused_before_loading(
        store: Store, keys: Keys, core: ServingCore, controller: Controller,
        tmp_path: Path, monkeypatch) -> None:
    """The controller reads every header before the load: a header claiming more bytes than
    the file holds fails the assignment with the parser's reason, and nothing reaches the
    core; a sound model's report carries the estimate (weights + KV cache)."""
    import struct

    from mlx_fleet.testmodel import make_test_model

    loads: list[str] = []
    real = core.load_model

    async def counting(model_id, *a, **kw):
        loads.append(model_id)
        return await real(model_id, *a, **kw)

    monkeypatch.setattr(core, "load_model", counting)
    model = make_test_model(tmp_path / "hostile")
    weights = next(model.glob("model*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(struct.pack("<Q", len(data) * 10) + data[8:])
    start = (await store.list(keys.root + "/")).revision + 1
    a = https_assignment("hostile", f"file://{model}")
    await store.put(keys.assignment(NODE, "default", "hostile", "r1"), a.to_json())
    seen = await report_events(store, keys.report(NODE, "default", "hostile", "r1"), start,
                               settled)
    assert seen[-1] is not None and seen[-1].state == AssignmentState.FAILED
    assert seen[-1].reason == "HeaderBeyondFile" and weights.name in seen[-1].message
    assert loads == []

    sound = make_test_model(tmp_path / "sound")
    a = https_assignment("sound", f"file://{sound}")
    await store.put(keys.assignment(NODE, "default", "sound", "r1"), a.to_json())
    seen = await report_events(store, keys.report(NODE, "default", "sound", "r1"), start,
                               settled)
    ready = seen[-1]
    assert ready is not None and ready.state == AssignmentState.READY and loads == ["sound"]
    assert 0 < ready.resident_bytes < ready.estimated_bytes  # + the KV cache
