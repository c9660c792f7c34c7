"""A local, in-memory fake of the Hugging Face Hub HTTP API for tests (model repos only).

Contract
--------
``HubServer`` serves on ``127.0.0.1`` (random free port, background thread, stdlib only) enough of
the Hub HTTP API that the *real, unmodified* ``huggingface_hub`` 1.33 client works against it when
pointed at ``server.url`` (``HfApi(endpoint=server.url, token="x")``; ``hf_hub_download`` /
``snapshot_download`` with ``endpoint=server.url``).  Nothing leaves the machine.

Routes (``{repo}`` is always ``namespace/name``; revisions are branch, tag or full 40-hex sha)::

    POST   /api/repos/create                      create_repo (409 if it exists)
    DELETE /api/repos/delete                      delete_repo
    GET    /api/models/{repo}[/revision/{rev}]    repo_info / model_info (sha, siblings)
    GET    /api/models/{repo}/refs                list_repo_refs
    GET    /api/models/{repo}/commits/{rev}       list_repo_commits (newest first, one page)
    GET    /api/models/{repo}/tree/{rev}[/{path}] list_repo_tree / list_repo_files (?recursive=)
    POST   /api/models/{repo}/paths-info/{rev}    get_paths_info (form or JSON body)
    POST   /api/models/{repo}/preupload/{rev}     always uploadMode "regular" (never LFS / Xet)
    POST   /api/models/{repo}/commit/{rev}        NDJSON commit; atomic; 412 on stale parentCommit
    POST   /api/models/{repo}/tag/{rev}           create_tag (tags immutable: 409 if it exists)
    DELETE /api/models/{repo}/tag/{tag}           delete_tag
    POST   /api/models/{repo}/branch/{branch}     create_branch;  DELETE: delete_branch
    HEAD   /{repo}/resolve/{rev}/{path}           X-Repo-Commit, ETag, Content-Length, Accept-Ranges
    GET    /{repo}/resolve/{rev}/{path}           same + body; honours single ``Range`` (206 / 416)
    GET    /api/whoami-v2, POST /api/validate-yaml, GET /api/agent-harnesses   (trivial stubs)

Errors carry ``X-Error-Code`` (``RepoNotFound`` / ``RevisionNotFound`` / ``EntryNotFound`` /
``CommitConflict``), ``X-Error-Message`` and a JSON ``{"error": ...}`` body, as the client expects.

Model: every repo has a real history.  A commit = 40-hex sha, parent sha, title, description, date
and a full snapshot ``{path: git-blob-sha1}``; blob bytes are stored by git blob sha1, which is also
the tree ``oid``, the preupload ``oid`` and the download ``ETag`` (quoted).  ``create_repo`` makes an
"initial commit" with an EMPTY tree on ``main``.  A commit is built completely, then the branch
pointer is swapped under one lock: all-or-nothing.  Any bearer token is accepted;
``require_token=True`` answers 401 to requests without one.

Test hooks (plain methods): ``url``, ``reset()``, ``head(repo, branch)``, ``files(repo, rev)``,
``commits(repo, rev)``, ``refs(repo)``, ``commit_files(repo, files, ...)`` (seed without HTTP),
``tamper(repo, path, data, revision)``, ``fail_next_commit(mode)`` /
``fail_next_commit_after_preupload()``, ``requests`` / ``clear_requests()``, ``require_token``.

Fault injection (the Hub misbehaving, for N requests or until cleared)::

    inject_fault(pattern, kind="status", status=503, times=None, methods=None) -> Fault
    fail_file(path, kind=..., ...)     same, for one repo file's /resolve URL (any repo, any revision)
    clear_faults();  faults             (each Fault counts its ``hits``)
    restart()                           listen again on the same port after a "stop" fault

``pattern`` is an ``fnmatch`` pattern on the request path (``*`` crosses ``/``). Kinds: ``"status"`` answers
``status`` (all methods by default); ``"drop"`` closes the connection without an answer; ``"truncate"`` sends the
headers (full ``Content-Length``) and half the body, then closes; ``"short"`` sends half the body with a matching
``Content-Length`` (a complete-looking but short answer: the size check against HEAD must catch it); ``"stop"``
sends half the body, then stops the whole server (new connections are refused until ``restart()``). The body
kinds apply to GET only by default. Faulted requests are logged with ``fault`` = the kind.

Fixtures: ``hub_server`` (a started server, stopped afterwards; telemetry disabled), ``hub_env``
(same server, and also made the process-wide default endpoint: ``HF_ENDPOINT``,
``huggingface_hub.constants.ENDPOINT`` and the resolve-URL template are patched for the test) and
``fast_retries`` (huggingface_hub's retry and resume waits shortened to nothing, so a fault test runs every
retry the client makes, in milliseconds).
Limitations: no LFS/Xet, no pull requests, no ``expand``/``lastCommit`` data, no pagination,
datasets/spaces unsupported, repo ids must have a namespace.
"""

from __future__ import annotations

import base64
import binascii
import collections
import fnmatch
import hashlib
import itertools
import json
import re
import threading
import time
import types
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

MAX_BODY_BYTES = 1 << 30  # same 1 GB payload limit as the Hub's /commit for inline files
MAX_LOG = 10_000
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data`` (what the Hub uses as oid/ETag for regular files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HubError(Exception):
    """An HTTP error answer: status, message and optional ``X-Error-Code``."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None,
                 extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, dict(headers or {})
        self.extra = dict(extra or {})  # more JSON body fields (create_repo's 409 must carry "url")


FAULT_KINDS = ("status", "drop", "truncate", "short", "stop")
BODY_FAULTS = ("truncate", "short", "stop")


@dataclass
class Fault:
    """One injected misbehaviour: requests whose path matches ``pattern`` (fnmatch) and method is in ``methods``
    get ``kind``; ``remaining`` such requests (None: until cleared). ``hits`` counts the requests it hit."""

    pattern: str
    kind: str
    status: int
    remaining: int | None
    methods: tuple[str, ...]
    hits: int = 0

    def take(self, method: str, path: str) -> bool:
        if method not in self.methods or not fnmatch.fnmatchcase(path, self.pattern):
            return False
        if self.remaining is not None:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
        self.hits += 1
        return True


@dataclass
class Commit:
    sha: str
    parent: str | None
    title: str
    description: str
    date: str
    tree: dict[str, str]  # path -> git blob sha1


@dataclass
class Repo:
    repo_id: str
    created_at: str
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name -> (sha, message)


def _check_path(path: str) -> str:
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise HubError(400, f"Invalid path in repo: {path!r}")
    return path


class HubServer:
    """In-memory Hub with a real commit history, served over HTTP on 127.0.0.1."""

    def __init__(self, require_token: bool = False):
        self._initial_require_token = require_token
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._life = threading.Lock()  # start / stop / restart, also from a handler thread ("stop" fault)
        self.reset()

    # ----------------------------------------------------------------- lifecycle
    def start(self, port: int = 0) -> "HubServer":
        with self._life:
            handler = type("BoundHubHandler", (_Handler,), {"hub": self})
            self._httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
            self._httpd.daemon_threads = True
            self._port = self._httpd.server_address[1]
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening (new connections are refused); state is kept, ``restart()`` serves it again."""
        with self._life:
            if self._httpd is not None:
                self._httpd.shutdown()
                self._httpd.server_close()
                self._thread.join(timeout=10)
                self._httpd = self._thread = None

    def restart(self) -> "HubServer":
        """Listen again on the same port (after ``stop()`` or a "stop" fault), with the same repos."""
        self.stop()
        return self.start(self._port)

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._port is not None, "server not started"
        return f"http://127.0.0.1:{self._port}"

    # ----------------------------------------------------------------- test hooks
    def reset(self) -> None:
        """Forget every repo, blob, tamper, pending failure and logged request."""
        with self._lock:
            self._repos: dict[str, Repo] = {}
            self._blobs: dict[str, bytes] = {}
            self._tampered: dict[tuple[str, str, str], bytes] = {}
            self._fail_next_commit: str | int | None = None
            self._faults: list[Fault] = []
            self._log: collections.deque = collections.deque(maxlen=MAX_LOG)
            self.require_token = self._initial_require_token

    def head(self, repo_id: str, branch: str = "main") -> str:
        with self._lock:
            repo = self._repo(repo_id)
            if branch not in repo.branches:
                raise KeyError(f"no branch {branch!r} in {repo_id}")
            return repo.branches[branch]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """``{path: bytes}`` of ``revision`` exactly as ``/resolve`` serves them (tampering included)."""
        with self._lock:
            commit = self._resolve(repo_id, revision)
            return {p: self._content(repo_id, commit, p) for p in sorted(commit.tree)}

    def commits(self, repo_id: str, revision: str = "main") -> list[dict]:
        """History reachable from ``revision``, newest first: dicts with sha, parent, title, description."""
        with self._lock:
            return [
                {"sha": c.sha, "parent": c.parent, "title": c.title, "description": c.description}
                for c in self._history(repo_id, self._resolve(repo_id, revision))
            ]

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        with self._lock:
            repo = self._repo(repo_id)
            return {"branches": dict(repo.branches), "tags": {k: v[0] for k, v in repo.tags.items()}}

    def commit_files(self, repo_id: str, files: dict[str, bytes], deletes=(), message: str = "seed",
                     branch: str = "main") -> str:
        """Commit directly (no HTTP); creates the repo if missing. Returns the new commit sha."""
        with self._lock:
            if repo_id not in self._repos:
                self._create_repo(repo_id)
            ops = [("file", p, bytes(b)) for p, b in files.items()] + [("deletedFile", p, None) for p in deletes]
            return self._apply_commit(repo_id, branch, ops, message, "", None).sha

    def tamper(self, repo_id: str, path: str, new_bytes: bytes, revision: str = "main") -> None:
        """Serve ``new_bytes`` for ``path`` at the commit ``revision`` resolves to NOW, without changing
        any commit, tree oid, size metadata or ETag (a corrupted server). Content-Length follows the
        new bytes so the client's size check passes. Later commits do not inherit the tampering."""
        with self._lock:
            commit = self._resolve(repo_id, revision)
            if path not in commit.tree:
                raise KeyError(f"{path!r} not in {repo_id}@{revision}")
            self._tampered[(repo_id, commit.sha, path)] = bytes(new_bytes)

    def fail_next_commit(self, mode: str | int = "disconnect") -> None:
        """Make the next ``/commit`` request not apply. ``"disconnect"``: the body is read, then the
        connection is closed without any answer (a publisher/server killed mid-commit; the client
        sees an ``httpx`` transport error). An int: answer with that HTTP status instead."""
        with self._lock:
            self._fail_next_commit = mode

    def fail_next_commit_after_preupload(self) -> None:
        """Alias of ``fail_next_commit("disconnect")``: preupload succeeds, the commit never lands."""
        self.fail_next_commit("disconnect")

    def inject_fault(self, pattern: str, kind: str = "status", *, status: int = 503, times: int | None = None,
                     methods: tuple[str, ...] | None = None) -> Fault:
        """Misbehave on requests whose path matches ``pattern`` (see the module docstring for the kinds)."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}: expected one of {FAULT_KINDS}")
        default = ("GET",) if kind in BODY_FAULTS else ("GET", "HEAD", "POST", "DELETE")
        fault = Fault(pattern, kind, status, times, tuple(methods or default))
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail_file(self, path: str, kind: str = "status", **kw) -> Fault:
        """``inject_fault`` for the /resolve URL of repo file ``path`` (any repo, any revision)."""
        return self.inject_fault(f"/*/resolve/*/{path}", kind, **kw)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            return next((f for f in self._faults if f.take(method, path)), None)

    @property
    def requests(self) -> list[dict]:
        """Logged requests, oldest first: {method, path, query, status, auth, time}. status 0 = dropped."""
        with self._lock:
            return list(self._log)

    def clear_requests(self) -> None:
        with self._lock:
            self._log.clear()

    # ----------------------------------------------------------------- model (call with lock held)
    def _repo(self, repo_id: str) -> Repo:
        repo = self._repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _resolve(self, repo_id: str, revision: str) -> Commit:
        repo = self._repo(repo_id)
        rev = revision
        for prefix in ("refs/heads/", "refs/tags/"):
            rev = rev[len(prefix):] if rev.startswith(prefix) else rev
        if rev in repo.branches:
            return repo.commits[repo.branches[rev]]
        if rev in repo.tags:
            return repo.commits[repo.tags[rev][0]]
        if rev in repo.commits:
            return repo.commits[rev]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _history(self, repo_id: str, commit: Commit) -> list[Commit]:
        repo, out, cur = self._repos[repo_id], [], commit
        for _ in range(len(repo.commits)):  # bounded walk to the root
            out.append(cur)
            if cur.parent is None:
                break
            cur = repo.commits[cur.parent]
        return out

    def _content(self, repo_id: str, commit: Commit, path: str) -> bytes:
        return self._tampered.get((repo_id, commit.sha, path), self._blobs[commit.tree[path]])

    def _create_repo(self, repo_id: str) -> Repo:
        repo = Repo(repo_id=repo_id, created_at=_now())
        self._repos[repo_id] = repo
        root = self._new_commit(repo, None, {}, "initial commit", "")
        repo.branches["main"] = root.sha
        return repo

    def _new_commit(self, repo: Repo, parent: str | None, tree: dict, title: str, description: str) -> Commit:
        listing = "".join(f"{p}\0{o}\n" for p, o in sorted(tree.items()))
        raw = f"tree {hashlib.sha1(listing.encode()).hexdigest()}\nparent {parent}\nseq {next(self._seq)}\n" \
              f"time {time.time_ns()}\n\n{title}\n\n{description}"
        commit = Commit(hashlib.sha1(raw.encode()).hexdigest(), parent, title, description, _now(), tree)
        repo.commits[commit.sha] = commit
        return commit

    def _apply_commit(self, repo_id, branch, ops, title, description, parent_commit) -> Commit:
        """Build the new tree completely, then swap the branch pointer (caller holds the lock)."""
        repo = self._repo(repo_id)
        if branch not in repo.branches:
            if branch in repo.tags or branch in repo.commits:
                raise HubError(400, f"Cannot commit to {branch!r}: not a branch")
            raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        head = repo.branches[branch]
        if parent_commit is not None and not (
            parent_commit == head or (len(parent_commit) >= 7 and head.startswith(parent_commit))
        ):
            raise HubError(
                412,
                f"Conflict: a commit has happened since. parentCommit {parent_commit} is not the head of "
                f"branch {branch!r} (head is {head}). Please refresh and try again.",
                "CommitConflict",
            )
        tree, staged = dict(repo.commits[head].tree), {}
        for kind, path, data in ops:
            if kind == "file":
                oid = git_blob_sha1(data)
                staged[oid] = data
                tree[_check_path(path)] = oid
            elif kind == "deletedFile":
                if tree.pop(path, None) is None:
                    raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            elif kind == "deletedFolder":
                prefix = path.rstrip("/") + "/"
                doomed = [p for p in tree if p.startswith(prefix)]
                if not doomed:
                    raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in doomed:
                    del tree[p]
        commit = self._new_commit(repo, head, tree, title, description)
        self._blobs.update(staged)
        repo.branches[branch] = commit.sha  # the atomic swap
        return commit

    def _entries(self, commit: Commit, base: str, recursive: bool) -> list[dict]:
        """Tree entries (files and directories) under ``base`` ('' = root)."""
        prefix = base + "/" if base else ""
        files = {p: o for p, o in commit.tree.items() if p.startswith(prefix)}
        if base and not files:
            raise HubError(404, f"Entry not found: {base}", "EntryNotFound")
        out: dict[str, dict] = {}
        for path, oid in files.items():
            rest = path[len(prefix):].split("/")
            for depth in range(1, len(rest)):
                d = prefix + "/".join(rest[:depth])
                out.setdefault(d, self._dir_entry(commit, d))
                if not recursive:
                    break
            if recursive or len(rest) == 1:
                out[path] = self._file_entry(path, oid)
        return [out[k] for k in sorted(out)]

    def _file_entry(self, path: str, oid: str) -> dict:
        return {"type": "file", "oid": oid, "size": len(self._blobs[oid]), "path": path}

    @staticmethod
    def _dir_entry(commit: Commit, path: str) -> dict:
        listing = "".join(f"{p}\0{o}\n" for p, o in sorted(commit.tree.items()) if p.startswith(path + "/"))
        return {"type": "directory", "oid": hashlib.sha1(listing.encode()).hexdigest(), "size": 0, "path": path}


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer  # bound by HubServer.start
    protocol_version = "HTTP/1.0"  # one request per connection: simple and robust
    timeout = 60
    server_version = "FakeHub/1.0"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_DELETE(self):
        self._dispatch("DELETE")

    # ----------------------------------------------------------------- plumbing
    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        path = unquote(split.path)
        self._fault = self.hub._take_fault(method, path)
        self._log_entry = {"method": method, "path": path, "query": query, "status": 0,
                           "auth": bool(self.headers.get("Authorization")),
                           "fault": self._fault.kind if self._fault else None}
        self._logged = False
        try:
            auth = self.headers.get("Authorization", "")
            has_token = auth.startswith("Bearer ") and len(auth) > len("Bearer ")
            if self.hub.require_token and not has_token:
                raise HubError(401, "Authentication required: missing bearer token")
            if self._fault is not None and self._fault.kind == "status":
                self._body()  # read what was sent, then answer the injected error
                raise HubError(self._fault.status, f"Injected fault on {method} {path} (fake hub test hook)")
            if self._fault is not None and self._fault.kind == "drop":
                self.close_connection = True  # no answer at all
                return
            self._route(method, split.path, query)
        except HubError as e:
            self._send_json(e.status, {"error": e.message, **e.extra}, error=e)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away mid-answer
        except Exception as e:  # a bug in the fake: make it loud, never hang the client
            self._send_json(500, {"error": f"fake hub internal error: {type(e).__name__}: {e}"})
        finally:
            if not self._logged:  # no answer was sent (status 0)
                self._log(0)

    def _log(self, status: int) -> None:
        """Log before the answer goes out, so a client that got its answer always sees its request."""
        self._logged = True
        with self.hub._lock:
            self.hub._log.append({**self._log_entry, "status": status, "time": time.time()})

    def _send(self, status: int, body: bytes, headers: dict) -> None:
        self._log(status)
        fault = self._fault if self._fault is not None and self._fault.kind in BODY_FAULTS else None
        if fault is not None and self.command != "HEAD" and body:
            return self._send_broken(fault, status, body, headers)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _send_broken(self, fault: Fault, status: int, body: bytes, headers: dict) -> None:
        """Half the body; "short" also says so in Content-Length; "stop" then takes the whole server down."""
        part = body[: len(body) // 2]
        if fault.kind == "short":
            headers = {**headers, "Content-Length": len(part)}
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(part)
        self.wfile.flush()
        self.close_connection = True
        if fault.kind == "stop":
            self.hub.stop()  # before this connection closes: the client's retries find nothing listening

    def _send_json(self, status: int, obj, error: HubError | None = None, headers: dict | None = None) -> None:
        body = json.dumps(obj).encode()
        hdrs = {"Content-Type": "application/json", "Content-Length": len(body), **(headers or {})}
        if error is not None:
            hdrs["X-Error-Message"] = error.message.encode("ascii", "replace").decode().replace("\n", " ")
            if error.code:
                hdrs["X-Error-Code"] = error.code
            hdrs.update(error.headers)
        self._send(status, body, hdrs)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            for _ in range(1_000_000):  # bounded chunk loop
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    raise HubError(413, "Payload too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise HubError(413, "Payload too large")
        return self.rfile.read(length) if length else b""

    def _json_body(self) -> dict:
        try:
            return json.loads(self._body() or b"{}")
        except ValueError:
            raise HubError(400, "Invalid JSON body")

    # ----------------------------------------------------------------- routing
    def _route(self, method: str, raw_path: str, query: dict) -> None:
        seg = raw_path.strip("/").split("/")
        if len(seg) > 4096:
            raise HubError(414, "Path too long")
        api = seg[0] == "api"
        if api and seg[1:3] == ["repos", "create"] and method == "POST":
            return self._create_repo(self._json_body())
        if api and seg[1:3] == ["repos", "delete"] and method == "DELETE":
            return self._delete_repo(self._json_body())
        if api and seg[1:] == ["whoami-v2"]:
            return self._send_json(200, {"type": "user", "name": "megabake-test", "orgs": [],
                                         "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
        if api and seg[1:] == ["validate-yaml"]:
            self._body()
            return self._send_json(200, {"errors": [], "warnings": []})
        if api and seg[1:] == ["agent-harnesses"]:
            return self._send_json(200, {"standardEnvVars": [], "harnesses": {}})
        if api and len(seg) >= 4 and seg[1] == "models":
            repo_id = f"{unquote(seg[2])}/{unquote(seg[3])}"
            return self._api_repo(method, repo_id, seg[4:], query)
        if not api and len(seg) >= 5 and seg[2] == "resolve" and method in ("GET", "HEAD"):
            repo_id = f"{unquote(seg[0])}/{unquote(seg[1])}"
            return self._resolve_file(repo_id, unquote(seg[3]), unquote("/".join(seg[4:])))
        raise HubError(404, f"No route for {method} {raw_path} (fake hub: model repos only)")

    def _create_repo(self, payload: dict) -> None:
        name, org = payload.get("name"), payload.get("organization")
        if payload.get("type", "model") not in ("model", None):
            raise HubError(400, "Only model repos are supported by the fake hub")
        if not (isinstance(org, str) and _NAME_RE.match(org) and isinstance(name, str) and _NAME_RE.match(name)):
            raise HubError(400, "repo id must be 'namespace/name' with a valid namespace and name")
        repo_id = f"{org}/{name}"
        with self.hub._lock:
            if repo_id in self.hub._repos:
                raise HubError(409, "You already created this model repo", extra={"url": f"{self.hub.url}/{repo_id}"})
            self.hub._create_repo(repo_id)
        self._send_json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": repo_id})

    def _delete_repo(self, payload: dict) -> None:
        repo_id = f"{payload.get('organization')}/{payload.get('name')}"
        with self.hub._lock:
            self.hub._repo(repo_id)
            del self.hub._repos[repo_id]
        self._send_json(200, {})

    def _api_repo(self, method: str, repo_id: str, rest: list[str], query: dict) -> None:
        hub = self.hub
        action = rest[0] if rest else ""
        arg = unquote(rest[1]) if len(rest) > 1 else "main"
        if method == "GET" and action in ("", "revision"):
            with hub._lock:
                repo = hub._repo(repo_id)
                c = hub._resolve(repo_id, arg)
                siblings = [{"rfilename": p, "size": len(hub._blobs[o]), "blobId": o}
                            for p, o in sorted(c.tree.items())]
                info = {"_id": repo_id, "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                        "sha": c.sha, "lastModified": c.date, "createdAt": repo.created_at, "private": False,
                        "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                        "siblings": siblings}
            return self._send_json(200, info)
        if method == "GET" and action == "refs":
            with hub._lock:
                repo = hub._repo(repo_id)
                refs = {
                    "branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                                 for b, s in sorted(repo.branches.items())],
                    "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s}
                             for t, (s, _) in sorted(repo.tags.items())],
                    "converts": [], "pullRequests": [],
                }
            return self._send_json(200, refs)
        if method == "GET" and action == "commits":
            with hub._lock:
                hist = hub._history(repo_id, hub._resolve(repo_id, arg))
                out = [{"id": c.sha, "title": c.title, "date": c.date, "authors": [{"user": "megabake-test"}],
                        "message": c.title + (f"\n\n{c.description}" if c.description else "")} for c in hist]
            return self._send_json(200, out)
        if method == "GET" and action == "tree":
            base = unquote("/".join(rest[2:])).strip("/")
            recursive = query.get("recursive", "false").lower() in ("1", "true")
            with hub._lock:
                entries = hub._entries(hub._resolve(repo_id, arg), base, recursive)
            return self._send_json(200, entries)
        if method == "POST" and action == "paths-info":
            return self._paths_info(repo_id, arg)
        if method == "POST" and action == "preupload":
            payload = self._json_body()
            with hub._lock:
                c = hub._resolve(repo_id, arg)
                files = []
                for f in payload.get("files", [])[:100_000]:
                    entry = {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                    if f["path"] in c.tree:
                        entry["oid"] = c.tree[f["path"]]
                    files.append(entry)
            return self._send_json(200, {"files": files, "commitOid": c.sha})
        if method == "POST" and action == "commit":
            return self._commit(repo_id, arg, query)
        if method == "POST" and action == "tag":
            payload = self._json_body()
            tag = payload.get("tag")
            if not isinstance(tag, str) or not tag or any(ch in tag for ch in " ~^:?*[\\") or ".." in tag:
                raise HubError(400, f"Invalid tag name: {tag!r}")
            with hub._lock:
                repo, c = hub._repo(repo_id), hub._resolve(repo_id, arg)
                if tag in repo.tags:
                    raise HubError(409, f"Tag {tag!r} already exists (tags are immutable)")
                repo.tags[tag] = (c.sha, payload.get("message"))
            return self._send_json(200, {"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": c.sha})
        if method == "DELETE" and action == "tag" and len(rest) > 1:
            with hub._lock:
                if hub._repo(repo_id).tags.pop(arg, None) is None:
                    raise HubError(404, f"Tag {arg!r} not found", "RevisionNotFound")
            return self._send_json(200, {})
        if action == "branch" and len(rest) > 1 and method in ("POST", "DELETE"):
            return self._branch(method, repo_id, arg)
        raise HubError(404, f"No route for {method} /api/models/{repo_id}/{'/'.join(rest)}")

    def _branch(self, method: str, repo_id: str, branch: str) -> None:
        payload = self._json_body() if method == "POST" else {}
        with self.hub._lock:
            repo = self.hub._repo(repo_id)
            if method == "DELETE":
                if branch == "main":
                    raise HubError(400, "Cannot delete the main branch")
                if repo.branches.pop(branch, None) is None:
                    raise HubError(404, f"Branch {branch!r} not found", "RevisionNotFound")
            else:
                if branch in repo.branches:
                    raise HubError(409, f"Branch {branch!r} already exists")
                if not _NAME_RE.match(branch):
                    raise HubError(400, f"Invalid branch name {branch!r}")
                start = payload.get("startingPoint") or "main"
                repo.branches[branch] = self.hub._resolve(repo_id, start).sha
        self._send_json(200, {})

    def _paths_info(self, repo_id: str, rev: str) -> None:
        body = self._body()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            paths = json.loads(body or b"{}").get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        hub, out = self.hub, []
        with hub._lock:
            c = hub._resolve(repo_id, rev)
            for p in [str(p).strip("/") for p in paths][:100_000]:
                if p in c.tree:
                    out.append(hub._file_entry(p, c.tree[p]))
                elif any(q.startswith(p + "/") for q in c.tree):
                    out.append(hub._dir_entry(c, p))
        self._send_json(200, out)

    def _commit(self, repo_id: str, branch: str, query: dict) -> None:
        if query.get("create_pr") in ("1", "true"):
            raise HubError(400, "Pull requests are not supported by the fake hub")
        body = self._body()
        header, ops = None, []
        for n, line in enumerate(body.split(b"\n")):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                key, value = item["key"], item["value"]
            except (ValueError, KeyError, TypeError):
                raise HubError(400, f"Invalid NDJSON line {n}")
            if key == "header":
                header = value
            elif key == "file":
                if value.get("encoding", "base64") == "base64":
                    try:
                        data = base64.b64decode(value["content"], validate=True)
                    except (binascii.Error, ValueError):
                        raise HubError(400, f"Invalid base64 content for {value.get('path')}")
                else:
                    data = value["content"].encode()
                ops.append(("file", value["path"], data))
            elif key in ("deletedFile", "deletedFolder"):
                ops.append((key, value["path"], None))
            elif key == "lfsFile":
                raise HubError(400, "LFS/Xet uploads are not supported by the fake hub (preupload says 'regular')")
            else:
                raise HubError(400, f"Unsupported commit operation {key!r}")
        if not header or not header.get("summary"):
            raise HubError(400, "Commit header with a non-empty summary is required")
        hub = self.hub
        with hub._lock:
            hub._repo(repo_id)
            failure, hub._fail_next_commit = hub._fail_next_commit, None
            if failure is None:
                commit = hub._apply_commit(repo_id, branch, ops, header["summary"],
                                           header.get("description") or "", header.get("parentCommit"))
        if failure == "disconnect":
            self.close_connection = True  # no answer at all: the client sees the connection drop
            return
        if failure is not None:
            raise HubError(int(failure), "Injected commit failure (fake hub test hook)")
        self._send_json(200, {"success": True, "commitOid": commit.sha, "hookOutput": "", "pullRequestUrl": None,
                              "commitUrl": f"{hub.url}/{repo_id}/commit/{commit.sha}"})

    def _resolve_file(self, repo_id: str, rev: str, path: str) -> None:
        hub = self.hub
        with hub._lock:
            c = hub._resolve(repo_id, rev)
            if path not in c.tree:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", {"X-Repo-Commit": c.sha})
            data, etag = hub._content(repo_id, c, path), c.tree[path]
        size = len(data)
        headers = {"X-Repo-Commit": c.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream", "Content-Length": size}
        rng = self.headers.get("Range")
        m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", rng or "")
        if rng and m and (m.group(1) or m.group(2)):
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            else:
                start, end = max(size - int(m.group(2)), 0), size - 1
            if start >= size or end < start:
                raise HubError(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            headers.update({"Content-Range": f"bytes {start}-{end}/{size}", "Content-Length": end - start + 1})
            return self._send(206, data[start:end + 1], headers)
        self._send(200, data, headers)


@pytest.fixture
def hub_server(monkeypatch):
    """A started ``HubServer`` (fresh per test), stopped at teardown. Telemetry (which would call
    huggingface.co) is disabled for the test."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    server = HubServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fast_retries(monkeypatch):
    """huggingface_hub's waits between retries (1 s, 2 s, 4 s, 8 s, 8 s) and before resuming a broken download
    (1 s each) made instant for the test: every retry still happens, only the sleeping is skipped."""
    import huggingface_hub.file_download as file_download
    import huggingface_hub.utils._http as http

    fast = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
    fast.sleep = lambda seconds: None
    monkeypatch.setattr(http, "time", fast)
    monkeypatch.setattr(file_download, "time", fast)
    return fast


@pytest.fixture
def hub_env(hub_server, monkeypatch):
    """``hub_server``, also made the default endpoint for this process and its subprocesses:
    ``HF_ENDPOINT`` env, ``huggingface_hub.constants.ENDPOINT`` and the resolve-URL template are
    patched, so ``HfApi()`` / ``hf_hub_download(...)`` without ``endpoint=`` hit the fake hub."""
    from huggingface_hub import constants

    url = hub_server.url
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    return hub_server
