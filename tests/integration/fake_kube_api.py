"""A FAKE Kubernetes API server: it stands in for the Kubernetes API server, which cannot run
here, for the tests of the autoscaler's Kubernetes actuator.

A stdlib ``http.server`` in a thread on 127.0.0.1 (a free port) answering only the endpoints
the actuator calls:

    GET | PUT | PATCH  /apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale
    GET                /api/v1/namespaces/{namespace}/pods?labelSelector=k=v,...
    PATCH              /api/v1/namespaces/{namespace}/pods/{name}   (merge patch)

It keeps each deployment's spec replica count, its selector (``status.selector`` of the
scale) and a resourceVersion (one counter for the whole server, as etcd's revision), honours
a resourceVersion sent with a scale write as a precondition (409 Conflict when it is stale,
as the real server does), records every request it receives, and answers 404 for anything
else (other paths, other methods, objects it was not given). Pods have labels and
annotations; a list filters them by an equality-based label selector (400 for any other
form), a merge patch sets or (with null) removes annotations. Standing in for the ReplicaSet
controller, a scale-down deletes as many of the deployment's pods (those its selector
matches) at once, lowest ``controller.kubernetes.io/pod-deletion-cost`` first (absent: 0),
the newest first among equals; the real controller ranks unready pods before that, and node
spread after. Knobs, for scale writes only: ``fail_next_writes(n)`` answers 409 to the next
n without looking at them; ``race_next_writes(n)`` has "another writer" change the object
just before each of the next n, so a write carrying the resourceVersion it read fails its
precondition for real. No authentication, no TLS, no watch, no other resource.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

_SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
_PODS_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
_POD_PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_MERGE_PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")
_JSON_PATCH = "application/json-patch+json"


def scale_path(namespace: str, name: str) -> str:
    """The URL path of a deployment's scale subresource."""
    return f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"


def pods_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str  # without the query string
    query: dict[str, str]
    content_type: str | None
    body: Any  # the parsed JSON body, None when there was none
    status: int  # what the fake answered


@dataclass(slots=True)
class _Deployment:
    replicas: int
    resource_version: int
    uid: str
    selector: dict[str, str]


@dataclass(slots=True)
class _Pod:
    labels: dict[str, str]
    annotations: dict[str, str]
    resource_version: int
    uid: str
    created: int  # order of creation: the controller stand-in removes the newest first


class _Answer(Exception):
    """Ends a request with this status and a Kubernetes ``Status`` body."""

    def __init__(self, status: HTTPStatus, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.reason = reason or status.phrase.replace(" ", "")


@dataclass
class _State:
    deployments: dict[tuple[str, str], _Deployment] = field(default_factory=dict)
    pods: dict[tuple[str, str], _Pod] = field(default_factory=dict)
    deleted_pods: list[tuple[str, str]] = field(default_factory=list)
    requests: list[RecordedRequest] = field(default_factory=list)
    revision: int = 100
    fail_writes: int = 0
    race_writes: int = 0


class FakeKubeApi:
    """The fake API server; use as a context manager (or ``start`` / ``stop``)."""

    def __init__(self, deployments: dict[tuple[str, str], int] | None = None) -> None:
        """``deployments`` maps (namespace, name) to the initial spec replica count."""
        self._lock = threading.Lock()
        self._state = _State()
        for (namespace, name), replicas in (deployments or {}).items():
            self.add_deployment(namespace, name, replicas)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> FakeKubeApi:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> FakeKubeApi:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake API server is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- state and knobs ---------------------------------------------------------------------

    def add_deployment(
        self, namespace: str, name: str, replicas: int, selector: dict[str, str] | None = None
    ) -> None:
        """``selector``: the labels of its pods (default ``app=<name>``)."""
        with self._lock:
            self._state.revision += 1
            self._state.deployments[(namespace, name)] = _Deployment(
                replicas,
                self._state.revision,
                f"uid-{namespace}-{name}",
                dict(selector or {"app": name}),
            )

    def add_pod(
        self,
        namespace: str,
        name: str,
        labels: dict[str, str],
        annotations: dict[str, str] | None = None,
    ) -> None:
        with self._lock:
            self._state.revision += 1
            self._state.pods[(namespace, name)] = _Pod(
                dict(labels),
                dict(annotations or {}),
                self._state.revision,
                f"uid-pod-{namespace}-{name}",
                len(self._state.pods) + len(self._state.deleted_pods),
            )

    def pod_annotations(self, namespace: str, name: str) -> dict[str, str]:
        with self._lock:
            return dict(self._state.pods[(namespace, name)].annotations)

    def pod_names(self, namespace: str) -> list[str]:
        """The pods of ``namespace`` that exist (not deleted by a scale-down), by name."""
        with self._lock:
            return sorted(name for ns, name in self._state.pods if ns == namespace)

    @property
    def deleted_pods(self) -> list[tuple[str, str]]:
        """(namespace, name) of the pods scale-downs deleted, in order."""
        with self._lock:
            return list(self._state.deleted_pods)

    def replicas(self, namespace: str, name: str) -> int:
        with self._lock:
            return self._state.deployments[(namespace, name)].replicas

    def resource_version(self, namespace: str, name: str) -> str:
        with self._lock:
            return str(self._state.deployments[(namespace, name)].resource_version)

    def fail_next_writes(self, count: int) -> None:
        """Answer 409 Conflict to the next ``count`` scale writes, whatever they say."""
        with self._lock:
            self._state.fail_writes = count

    def race_next_writes(self, count: int) -> None:
        """Before each of the next ``count`` scale writes, another writer updates the object
        (same replicas, new resourceVersion): a write preconditioned on what it read fails."""
        with self._lock:
            self._state.race_writes = count

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._state.requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._state.requests.clear()

    # -- request handling (called by the handler thread) ------------------------------------

    def _handle(
        self, method: str, target: str, content_type: str | None, raw: bytes
    ) -> tuple[int, dict[str, Any]]:
        parts = urlsplit(target)
        query = dict(parse_qsl(parts.query))
        body: Any = None
        status: int
        answer: dict[str, Any]
        with self._lock:
            try:
                if raw:
                    try:
                        body = json.loads(raw)
                    except ValueError as err:
                        raise _Answer(HTTPStatus.BAD_REQUEST, f"body is not JSON: {err}") from err
                status, answer = self._dispatch(method, parts.path, query, content_type, body)
            except _Answer as err:
                status, answer = err.status, _status_body(err)
            self._state.requests.append(
                RecordedRequest(method, parts.path, query, content_type, body, int(status))
            )
        return status, answer

    def _dispatch(
        self, method: str, path: str, query: dict[str, str], content_type: str | None, body: Any
    ) -> tuple[int, dict[str, Any]]:
        pods = _PODS_PATH.match(path)
        if pods is not None and method == "GET":
            return HTTPStatus.OK, self._list_pods(pods.group(1), query.get("labelSelector"))
        pod = _POD_PATH.match(path)
        if pod is not None and method == "PATCH":
            return HTTPStatus.OK, self._patch_pod(*pod.groups(), content_type, body)
        match = _SCALE_PATH.match(path)
        if match is None or method not in ("GET", "PUT", "PATCH"):
            raise _Answer(HTTPStatus.NOT_FOUND, f"the fake serves no {method} {path}")
        namespace, name = match.groups()
        deployment = self._state.deployments.get((namespace, name))
        if deployment is None:
            raise _Answer(HTTPStatus.NOT_FOUND, f'deployments.apps "{name}" not found')
        if method == "GET":
            return HTTPStatus.OK, _scale_body(namespace, name, deployment)

        if self._state.fail_writes > 0:
            self._state.fail_writes -= 1
            raise _Answer(HTTPStatus.CONFLICT, _conflict_message(name))
        if self._state.race_writes > 0:
            self._state.race_writes -= 1
            self._state.revision += 1
            deployment.resource_version = self._state.revision

        if method == "PUT":
            replicas, precondition = _from_put(body, namespace, name)
        else:
            replicas, precondition = _from_patch(content_type, body)
        if precondition is not None and precondition != str(deployment.resource_version):
            raise _Answer(HTTPStatus.CONFLICT, _conflict_message(name))
        if replicas is not None:
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                raise _Answer(
                    HTTPStatus.UNPROCESSABLE_ENTITY,
                    f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value: '
                    f"{replicas!r}: must be greater than or equal to 0",
                    reason="Invalid",
                )
            if replicas != deployment.replicas:
                self._remove_pods(namespace, deployment, deployment.replicas - replicas)
                deployment.replicas = replicas
                self._state.revision += 1
                deployment.resource_version = self._state.revision
        return HTTPStatus.OK, _scale_body(namespace, name, deployment)

    def _matching_pods(self, namespace: str, labels: dict[str, str]) -> list[tuple[str, _Pod]]:
        return [
            (name, pod)
            for (ns, name), pod in self._state.pods.items()
            if ns == namespace and all(pod.labels.get(k) == v for k, v in labels.items())
        ]

    def _remove_pods(self, namespace: str, deployment: _Deployment, count: int) -> None:
        """The ReplicaSet controller's scale-down, by deletion cost then age (see the doc)."""
        if count <= 0:
            return
        ranked = sorted(
            self._matching_pods(namespace, deployment.selector),
            key=lambda item: (int(item[1].annotations.get(DELETION_COST, "0")), -item[1].created),
        )
        for name, _ in ranked[:count]:
            del self._state.pods[(namespace, name)]
            self._state.deleted_pods.append((namespace, name))

    def _list_pods(self, namespace: str, selector: str | None) -> dict[str, Any]:
        labels = _equality_selector(selector)
        items = [
            _pod_body(namespace, name, pod) for name, pod in self._matching_pods(namespace, labels)
        ]
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self._state.revision)},
            "items": sorted(items, key=lambda item: item["metadata"]["name"]),
        }

    def _patch_pod(
        self, namespace: str, name: str, content_type: str | None, body: Any
    ) -> dict[str, Any]:
        pod = self._state.pods.get((namespace, name))
        if pod is None:
            raise _Answer(HTTPStatus.NOT_FOUND, f'pods "{name}" not found')
        if (content_type or "").split(";")[0].strip() not in _MERGE_PATCHES:
            raise _Answer(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"the fake takes merge patches of "
                          f"pods only, got {content_type!r}")  # fmt: skip
        if not isinstance(body, dict) or set(body) - {"metadata"}:
            raise _Answer(HTTPStatus.UNPROCESSABLE_ENTITY, "the fake patches pod metadata only")
        for key, value in ((body.get("metadata") or {}).get("annotations") or {}).items():
            if value is None:
                pod.annotations.pop(key, None)
            else:
                pod.annotations[key] = str(value)
        self._state.revision += 1
        pod.resource_version = self._state.revision
        return _pod_body(namespace, name, pod)


def _from_put(body: Any, namespace: str, name: str) -> tuple[Any, str | None]:
    if not isinstance(body, dict):
        raise _Answer(HTTPStatus.BAD_REQUEST, "a PUT needs a Scale object")
    metadata = body.get("metadata") or {}
    if metadata.get("name", name) != name or metadata.get("namespace", namespace) != namespace:
        raise _Answer(HTTPStatus.BAD_REQUEST, "the body's name/namespace do not match the URL")
    return (body.get("spec") or {}).get("replicas", 0), metadata.get("resourceVersion") or None


def _from_patch(content_type: str | None, body: Any) -> tuple[Any, str | None]:
    media = (content_type or "").split(";")[0].strip()
    if media in _MERGE_PATCHES:
        if not isinstance(body, dict):
            raise _Answer(HTTPStatus.BAD_REQUEST, "a merge patch is a JSON object")
        spec = body.get("spec") or {}
        metadata = body.get("metadata") or {}
        return spec.get("replicas"), metadata.get("resourceVersion") or None
    if media == _JSON_PATCH:
        if not isinstance(body, list):
            raise _Answer(HTTPStatus.BAD_REQUEST, "a JSON patch is a list of operations")
        replicas = None
        for op in body:
            if op.get("op") in ("replace", "add") and op.get("path") == "/spec/replicas":
                replicas = op.get("value")
            else:
                raise _Answer(HTTPStatus.UNPROCESSABLE_ENTITY, f"the fake supports no {op}")
        return replicas, None
    raise _Answer(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"unsupported patch type {content_type!r}")


def _scale_body(namespace: str, name: str, deployment: _Deployment) -> dict[str, Any]:
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": deployment.uid,
            "resourceVersion": str(deployment.resource_version),
        },
        "spec": {"replicas": deployment.replicas} if deployment.replicas else {},
        "status": {
            "replicas": deployment.replicas,
            "selector": ",".join(f"{k}={v}" for k, v in sorted(deployment.selector.items())),
        },
    }


def _pod_body(namespace: str, name: str, pod: _Pod) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": pod.uid,
            "resourceVersion": str(pod.resource_version),
            "labels": dict(pod.labels),
            "annotations": dict(pod.annotations),
        },
    }


def _equality_selector(selector: str | None) -> dict[str, str]:
    labels = {}
    for term in (selector or "").split(","):
        if not term:
            continue
        key, sep, value = term.partition("=")
        if not sep or not key or "!" in key or "(" in term or " " in term.strip():
            raise _Answer(HTTPStatus.BAD_REQUEST, f"the fake takes key=value selectors, got "
                          f"{selector!r}")  # fmt: skip
        labels[key] = value
    return labels


def _conflict_message(name: str) -> str:
    return (
        f'Operation cannot be fulfilled on deployments.apps "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again"
    )


def _status_body(err: _Answer) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": err.message,
        "reason": err.reason,
        "code": int(err.status),
    }


def _handler_for(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            status, answer = api._handle(
                self.command, self.path, self.headers.get("Content-Type"), raw
            )
            payload = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_PUT = do_PATCH = do_POST = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the request log is ``FakeKubeApi.requests``

    return Handler
