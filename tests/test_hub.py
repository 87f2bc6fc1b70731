"""Gate files on the Hub, against a local server that answers like huggingface.co (no test reaches the internet).

The server speaks the part of the Hub protocol that ``hf_hub_download`` and ``HfApi.upload_file`` use:
``HEAD/GET /{repo}/resolve/{revision}/{file}`` (``X-Repo-Commit``, ``ETag``; ``.safetensors`` files answer as LFS
files do, with a redirect to a second "CDN" server and ``X-Linked-Etag`` / ``X-Linked-Size``), ``X-Error-Code``
on 404s, and ``/api/repos/create``, ``/api/models/{repo}/preupload/{rev}``, ``/api/models/{repo}/commit/{rev}``.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import torch

import hf_sparse
from hf_sparse import gate_files
from hf_sparse import gates
from hf_sparse.tools import hub as hub_tools

from conftest import build, tiny_config

BLOCK = 16


class FakeHub:
    """In-memory repos (branch -> commit -> files) served over HTTP on 127.0.0.1, with a request log."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=False))
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(cdn=True))
        self.endpoint = f"http://127.0.0.1:{self.hub.server_port}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_port}"
        self.blobs: dict[str, bytes] = {}
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.hub, self.cdn)]
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    # -- repository state ---------------------------------------------------------------------------------
    def create(self, repo_id: str) -> None:
        with self.lock:
            self.repos.setdefault(repo_id, {"branches": {}, "commits": {}})

    def commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Add ``files`` on top of ``branch``; returns the new commit's 40-hex id."""
        with self.lock:
            repo = self.repos[repo_id]
            parent = repo["branches"].get(branch)
            tree = dict(repo["commits"][parent]) if parent else {}
            tree.update(files)
            sha = hashlib.sha1(repr((parent, sorted((k, hashlib.sha256(v).hexdigest()) for k, v in tree.items()))).encode()).hexdigest()
            repo["commits"][sha] = tree
            repo["branches"][branch] = sha
            return sha

    def count(self, method: str, contains: str = "") -> int:
        return sum(1 for m, path in self.requests if m == method and contains in path)

    # -- HTTP ---------------------------------------------------------------------------------------------
    def _handler(self, cdn: bool):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _send(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD" and body:
                    self.wfile.write(body)

            def _error(self, status: int, code: str, extra: dict[str, str] | None = None) -> None:
                body = json.dumps({"error": code}).encode()
                self._send(status, {"X-Error-Code": code, "Content-Type": "application/json", **(extra or {})}, body)

            def _record(self) -> str:
                path = unquote(urlsplit(self.path).path)
                with hub.lock:
                    hub.requests.append((self.command, ("cdn:" if cdn else "") + path))
                return path

            def do_HEAD(self) -> None:
                self._resolve(self._record())

            def do_GET(self) -> None:
                path = self._record()
                if cdn:
                    blob = hub.blobs.get(path.rsplit("/", 1)[-1])
                    if blob is None:
                        return self._error(404, "EntryNotFound")
                    return self._send(200, {"Content-Type": "application/octet-stream"}, blob)
                self._resolve(path)

            def _resolve(self, path: str) -> None:
                parts = path.strip("/").split("/")
                if cdn or len(parts) < 5 or parts[2] != "resolve":
                    return self._error(404, "RepoNotFound")
                repo_id, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(401, "RepoNotFound")
                commit = repo["branches"].get(revision, revision if revision in repo["commits"] else None)
                if commit is None:
                    return self._error(404, "RevisionNotFound")
                data = repo["commits"][commit].get(filename)
                if data is None:
                    return self._error(404, "EntryNotFound", {"X-Repo-Commit": commit})
                if filename.endswith(".safetensors"):  # stored with LFS: redirect to the CDN, metadata on the 302
                    digest = hashlib.sha256(data).hexdigest()
                    hub.blobs[digest] = data
                    return self._send(302, {
                        "X-Repo-Commit": commit, "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data)),
                        "ETag": f'"{hashlib.sha1(data).hexdigest()}"', "Location": f"{hub.cdn_url}/blobs/{digest}",
                        "Content-Length": "0",
                    })
                etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                self._send(200, {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}, data)

            def do_POST(self) -> None:
                path = self._record()
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                parts = path.strip("/").split("/")
                if path == "/api/repos/create":
                    payload = json.loads(body)
                    repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
                    hub.create(repo_id)
                    return self._send(200, {"Content-Type": "application/json"},
                                      json.dumps({"url": f"{hub.endpoint}/{repo_id}"}).encode())
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] in ("preupload", "commit"):
                    repo_id = "/".join(parts[2:4])
                    if repo_id not in hub.repos:
                        return self._error(404, "RepoNotFound")
                    if parts[4] == "preupload":
                        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                 for f in json.loads(body)["files"]]
                        return self._send(200, {"Content-Type": "application/json"}, json.dumps({"files": files}).encode())
                    added = {}
                    for line in body.splitlines():
                        item = json.loads(line)
                        if item["key"] == "file":
                            added[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                    sha = hub.commit(repo_id, added, branch=parts[5])
                    answer = {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha,
                              "pullRequestUrl": None}
                    return self._send(200, {"Content-Type": "application/json"}, json.dumps(answer).encode())
                self._error(404, "RepoNotFound")

        return Handler


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A running FakeHub with huggingface_hub pointed at it (as HF_ENDPOINT does at import) and a fresh cache."""
    from huggingface_hub import constants

    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_for_the_local_server")
    yield server
    server.close()


def _model(layers: int = 3, seed: int = 0):
    model = build(tiny_config(layers=layers), "sdpa", seed=seed)
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=BLOCK))
    return model


def _random_gates(model, seed: int) -> dict[int, torch.Tensor]:
    spec = gates.gate_spec(model)
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.rand(spec.shape, generator=generator) / BLOCK for i in spec.gated_layers}


def _same(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[i].cpu(), b[i].cpu()) for i in a)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name in ("hf_sparse.gates", "hf_sparse.gate_files")]


def test_push_then_download_round_trip(hub, tmp_path):
    source = _model()
    gates.set_gates(source, _random_gates(source, seed=1))
    info = hub_tools.push_gates_to_hub(source, "org/plas-gates")
    assert hub.count("POST", "/api/repos/create") == 1 and hub.count("POST", "/commit/main") == 1
    assert info.oid == hub.repos["org/plas-gates"]["branches"]["main"]

    target = _model()
    loaded = gate_files.load_gates(target, "org/plas-gates", strict=True)
    assert _same(loaded, gates.get_gates(source))
    assert _same(gates.get_gates(target), gates.get_gates(source))
    assert hub.count("HEAD", "/org/plas-gates/resolve/main/") == 1
    assert hub.count("GET", "cdn:/blobs/") == 1, "LFS-style redirect followed to the CDN"


def test_cache_is_reused_and_commit_pins_skip_the_network(hub, tmp_path):
    model = _model()
    gates.set_gates(model, _random_gates(model, seed=2))
    hub_tools.push_gates_to_hub(model, "org/cached")
    sha = hub.repos["org/cached"]["branches"]["main"]
    first = gate_files.load_gates(_model(), "org/cached", strict=True)
    downloads = hub.count("GET", "cdn:")
    second = gate_files.load_gates(_model(), "org/cached", strict=True)
    assert _same(first, second)
    assert hub.count("GET", "cdn:") == downloads == 1, "second load served from the cache (HEAD only)"
    requests = len(hub.requests)
    pinned = gate_files.load_gates(_model(), "org/cached", revision=sha, strict=True)
    assert _same(pinned, first) and len(hub.requests) == requests, "a cached commit id needs no request at all"


def test_revision_pinning_selects_the_commit(hub):
    model = _model()
    hub.create("org/versions")
    v1, v2 = _random_gates(model, seed=3), _random_gates(model, seed=4)
    gates.set_gates(model, v1)
    first = hub_tools.push_gates_to_hub(model, "org/versions", create_repo=False).oid
    gates.set_gates(model, v2)
    second = hub_tools.push_gates_to_hub(model, "org/versions", create_repo=False).oid
    assert first != second
    assert _same(gate_files.load_gates(_model(), "org/versions", revision=first, strict=True), v1)
    assert _same(gate_files.load_gates(_model(), "org/versions", revision=second, strict=True), v2)
    assert _same(gate_files.load_gates(_model(), "org/versions", strict=True), v2), "main is the newest commit"
    with pytest.raises(gate_files.GateFileError, match="revision not found"):
        gate_files.load_gates(_model(), "org/versions", revision="no-such-branch", strict=True)


def test_offline_mode_serves_a_warm_cache_and_fails_cleanly_on_a_cold_one(hub, monkeypatch, tmp_path, caplog):
    from huggingface_hub import constants

    model = _model()
    gates.set_gates(model, _random_gates(model, seed=5))
    hub_tools.push_gates_to_hub(model, "org/offline")
    online = gate_files.load_gates(_model(), "org/offline", strict=True)  # warms the cache
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    requests = len(hub.requests)
    offline = gate_files.load_gates(_model(), "org/offline", strict=True)
    assert _same(online, offline) and len(hub.requests) == requests, "offline: no request, cached file"

    cold = tmp_path / "cold-cache"
    with pytest.raises(gate_files.GateFileError, match="not in the local cache"):
        gate_files.load_gates(_model(), "org/offline", strict=True, cache_dir=cold)
    caplog.set_level(logging.WARNING)
    fallback = _model()
    assert gate_files.load_gates(fallback, "org/offline", cache_dir=cold) == {}
    assert gates.get_gates(fallback) == {} and len(_warnings(caplog)) == 1
    assert len(hub.requests) == requests


def test_missing_file_falls_back_with_one_warning_or_raises_when_strict(hub, caplog):
    hub.create("org/model-without-gates")
    hub.commit("org/model-without-gates", {"config.json": b"{}"})
    with pytest.raises(gate_files.GateFileError, match=rf"{gate_files.GATE_FILENAME} in Hub repo 'org/model-without-gates'.*no such file"):
        gate_files.load_gates(_model(), "org/model-without-gates", strict=True)
    caplog.set_level(logging.WARNING)
    model = _model()
    model.config._name_or_path = "org/model-without-gates"
    assert gate_files.autoload_gates(model) == {}
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and gate_files.GATE_FILENAME in warnings[0] and "mean-pooled" in warnings[0]
    assert gates.get_gates(model) == {}
    with pytest.raises(gate_files.GateFileError, match="repository not found"):
        gate_files.load_gates(_model(), "org/does-not-exist", strict=True)


def test_autoload_from_the_models_hub_repo_pins_its_commit(hub):
    model = _model()
    hub.create("org/plas-model")
    gates.set_gates(model, _random_gates(model, seed=6))
    old = hub_tools.push_gates_to_hub(model, "org/plas-model", create_repo=False).oid
    gates.set_gates(model, _random_gates(model, seed=7))
    hub_tools.push_gates_to_hub(model, "org/plas-model", create_repo=False)
    fresh = _model()
    fresh.config._name_or_path = "org/plas-model"
    fresh.config._commit_hash = old  # what from_pretrained records for the weights it loaded
    assert _same(gate_files.autoload_gates(fresh), _random_gates(model, seed=6))


def test_hf_endpoint_environment_variable_in_a_fresh_process(hub, tmp_path):
    """The documented user path: HF_ENDPOINT set before huggingface_hub is imported."""
    model = _model()
    gates.set_gates(model, _random_gates(model, seed=8))
    hub_tools.push_gates_to_hub(model, "org/env")
    expected = tmp_path / "expected.safetensors"
    gate_files.save_gates(model, tmp_path, expected.name)
    script = (
        "import sys, torch, hf_sparse; sys.path.insert(0, 'tests')\n"
        "from conftest import build, tiny_config\n"
        "from hf_sparse import gate_files, gates\n"
        "m = build(tiny_config(layers=3), 'sdpa'); hf_sparse.configure(m, hf_sparse.PLASConfig(block_size=16))\n"
        "got = gate_files.load_gates(m, 'org/env', strict=True)\n"
        f"ref = gate_files.read_gate_file({str(expected)!r}, gates.gate_spec(m))\n"
        "assert got.keys() == ref.keys() and all(torch.equal(got[i], ref[i]) for i in got)\n"
        "print('ok', len(got))\n"
    )
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "proc-cache"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok 2"
    assert hub.count("GET", "cdn:/blobs/") == 1
