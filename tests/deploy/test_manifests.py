"""Deployment assets parse, carry what their tools require, and agree with the code.

Nothing here starts Ray, Docker or Kubernetes: each asset is read as its tool
would read it (YAML, JSON, TOML, Dockerfile instructions) and checked against
the tool's own schema where one ships with our dependencies (Ray's cluster
schema), otherwise against the fields the tool requires.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from kvstore.deploy.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "deploy" / "assets"

ROUTER_PORT = 8000
CONFIG_PATH = "/etc/kvstore/kvstore.toml"
SERVE_COMMAND = f"kvstore serve --address auto --config {CONFIG_PATH}"
DEPLOY_DOC = REPO / "docs" / "deploy.md"

# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"instance", "job"})


class Documented(NamedTuple):
    """A row of the metric tables of docs/deploy.md: | `name` | type | `label`, ... | what |."""

    kind: str  # counter, gauge, histogram
    labels: frozenset[str]


def _documented_metrics() -> dict[str, Documented]:
    """The metric families the deployment guide documents, by name (as scraped: counters end in _total)."""
    metrics = {}
    for line in DEPLOY_DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.fullmatch(r"`kvstore_\w+`", cells[0]):
            continue
        name = cells[0].strip("`")
        assert name not in metrics, f"{name} documented twice"
        metrics[name] = Documented(cells[1].split(",")[0], frozenset(re.findall(r"`(\w+)`", cells[2])))
    return metrics


# Prometheus names and the labels a query may use: the workers', the tiers' and the router's, as documented.
METRIC_LABELS: dict[str, frozenset[str]] = {name: m.labels for name, m in _documented_metrics().items()}
HISTOGRAMS = frozenset(name for name, m in _documented_metrics().items() if m.kind == "histogram")

# The panels the dashboard must have, by the metrics they plot.
REQUIRED_DASHBOARD_METRICS = frozenset(
    {
        "kvstore_gpu_cache_usage_perc",
        "kvstore_prefix_cache_hits_total",
        "kvstore_prefix_cache_queries_total",
        "kvstore_router_cached_tokens_total",
        "kvstore_tier_usage_bytes",
        "kvstore_offload_bytes_total",
        "kvstore_offload_seconds_bucket",
        "kvstore_router_decisions_total",
        "kvstore_router_route_seconds_bucket",
        "kvstore_router_requests_total",
        "kvstore_router_event_lag_seconds_bucket",
        "kvstore_router_event_staleness_seconds",
        "kvstore_router_event_gaps_total",
        "kvstore_router_decode_errors_total",
    }
)


def _scraped_names() -> dict[str, frozenset[str]]:
    """Every series name a query may use, with the labels it carries."""
    names: dict[str, frozenset[str]] = {}
    for name, labels in METRIC_LABELS.items():
        if name in HISTOGRAMS:
            names[f"{name}_bucket"] = labels | {"le"}
            names[f"{name}_sum"] = labels
            names[f"{name}_count"] = labels
        else:
            names[name] = labels
    return names


SCRAPED = _scraped_names()


# --- helpers ---------------------------------------------------------------------------------------------------------


def _load_yaml(name: str) -> Any:
    return yaml.safe_load((ASSETS / name).read_text())


def _load_yaml_docs(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ASSETS / name).read_text()) if doc is not None]


_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti)?$")
_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (binary suffixes or plain bytes) in bytes."""
    match = _QUANTITY.match(str(quantity))
    assert match, f"unsupported quantity {quantity!r}"
    return int(match.group(1)) * _UNITS[match.group(2)]


def _dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continuation line"
    return instructions


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT_NOT_CALL = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*+(?!\s*\()")
_PROMQL_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset"})


def _promql_metrics(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers that are not calls, labels, ranges or keywords."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _GROUPING.sub("", text)
    return {name for name in _IDENT_NOT_CALL.findall(text) if name not in _PROMQL_KEYWORDS}


def _promql_grouping_labels(expr: str) -> set[str]:
    return {label.strip() for _, labels in _GROUPING.findall(expr) for label in labels.split(",") if label.strip()}


def _balanced(expr: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"[^"]*"', "", expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def _ray_pod_templates(cluster: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(group name, rayStartParams, pod spec) for the head and every worker group."""
    head = cluster["spec"]["headGroupSpec"]
    yield "head", head.get("rayStartParams", {}), head["template"]["spec"]
    for group in cluster["spec"]["workerGroupSpecs"]:
        yield group["groupName"], group.get("rayStartParams", {}), group["template"]["spec"]


# --- kvstore.toml ----------------------------------------------------------------------------------------------------


def test_example_config_loads_and_is_reachable_from_other_nodes() -> None:
    path = ASSETS / "kvstore.toml"
    config = load_config(path, env={})
    assert isinstance(config, Config)
    assert "every field is optional" in path.read_text().lower()
    assert config.router.port == ROUTER_PORT
    # Clients and Prometheus reach the router, and the router the producers, from other nodes.
    assert config.router.host == "0.0.0.0"
    for endpoint in (config.events.endpoint, config.events.replay_endpoint):
        assert "127.0.0.1" not in endpoint and "localhost" not in endpoint, endpoint


def test_example_config_has_every_section() -> None:
    text = (ASSETS / "kvstore.toml").read_text()
    sections = set(re.findall(r"^\[(\w+)\]", text, flags=re.MULTILINE))
    assert sections == set(Config.__struct_fields__)


# --- Ray cluster launcher --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster() -> dict[str, Any]:
    config = _load_yaml("ray-cluster.yaml")
    assert isinstance(config, dict)
    return config


def test_ray_cluster_matches_rays_schema(ray_cluster: dict[str, Any]) -> None:
    import ray

    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    if schema_path.exists():
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(ray_cluster, json.loads(schema_path.read_text()))
    for key in ("cluster_name", "provider", "auth", "available_node_types", "head_node_type", "max_workers"):
        assert key in ray_cluster, key
    assert ray_cluster["provider"]["type"] == "aws"
    assert ray_cluster["head_node_type"] in ray_cluster["available_node_types"]


def test_ray_cluster_passes_ray_up_validation(ray_cluster: dict[str, Any]) -> None:
    """What `ray up` does before it calls the cloud: fill defaults, then validate."""
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError:  # a private API; the schema test above still runs
        pytest.skip("this Ray has no ray.autoscaler._private.util.prepare_config")
    validate_config(prepare_config(json.loads(json.dumps(ray_cluster))))


def test_ray_cluster_has_a_cpu_head_and_gpu_workers(ray_cluster: dict[str, Any]) -> None:
    node_types = ray_cluster["available_node_types"]
    head = node_types[ray_cluster["head_node_type"]]
    gpu_families = ("g", "p")
    assert not head["node_config"]["InstanceType"].startswith(gpu_families)
    workers = [t for name, t in node_types.items() if name != ray_cluster["head_node_type"]]
    assert any(t["node_config"]["InstanceType"].startswith(gpu_families) and t["min_workers"] >= 1 for t in workers)


def test_ray_cluster_installs_torch_before_kvstore(ray_cluster: dict[str, Any]) -> None:
    for key, cpu_build in (("head_setup_commands", True), ("worker_setup_commands", False)):
        commands = ray_cluster[key]
        torch = next(i for i, c in enumerate(commands) if "pip install" in c and "torch==2.13.0" in c)
        kvstore = next(i for i, c in enumerate(commands) if re.search(r"pip install \S*kvstore\b", c))
        assert torch < kvstore, key
        assert ("whl/cpu" in commands[torch]) is cpu_build, key


def test_ray_cluster_starts_ray_with_a_fixed_metrics_port(ray_cluster: dict[str, Any]) -> None:
    head = " ".join(ray_cluster["head_start_ray_commands"])
    workers = " ".join(ray_cluster["worker_start_ray_commands"])
    assert "ray start --head" in head
    assert "--address=$RAY_HEAD_IP:6379" in workers
    for commands in (head, workers):
        assert "--metrics-export-port=8080" in commands
        assert "--object-store-memory=" in commands


def test_ray_cluster_mounts_existing_files_and_documents_serve(ray_cluster: dict[str, Any]) -> None:
    mounts = ray_cluster["file_mounts"]
    for local in mounts.values():
        assert (REPO / local).exists(), local
    assert any((REPO / local / "kvstore.toml").is_file() for local in mounts.values())
    assert any(CONFIG_PATH in command for command in ray_cluster["setup_commands"])
    assert SERVE_COMMAND in (ASSETS / "ray-cluster.yaml").read_text()


def test_ray_cluster_opens_the_router_port(ray_cluster: dict[str, Any]) -> None:
    rules = ray_cluster["provider"]["security_group"]["IpPermissions"]
    assert any(r["FromPort"] <= ROUTER_PORT <= r["ToPort"] and r["IpProtocol"] == "tcp" for r in rules)


# --- KubeRay ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kuberay() -> dict[str, dict[str, Any]]:
    docs = _load_yaml_docs("kuberay.yaml")
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object per kind"
    assert set(by_kind) == {"ConfigMap", "RayCluster", "RayJob", "Service"}
    for doc in docs:
        assert doc["metadata"]["name"]
    assert by_kind["RayCluster"]["apiVersion"] == "ray.io/v1"
    assert by_kind["RayJob"]["apiVersion"] == "ray.io/v1"
    assert by_kind["ConfigMap"]["apiVersion"] == "v1"
    assert by_kind["Service"]["apiVersion"] == "v1"
    return by_kind


def test_raycluster_has_head_and_gpu_worker_group(kuberay: dict[str, dict[str, Any]]) -> None:
    spec = kuberay["RayCluster"]["spec"]
    assert spec["headGroupSpec"]["template"]["spec"]["containers"]
    groups = spec["workerGroupSpecs"]
    assert groups
    for group in groups:
        assert group["groupName"]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"]
    gpus = [group["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu") for group in groups]
    assert any(gpus)


def test_ray_pods_mount_memory_backed_shm_sized_for_arena_and_object_store(
    kuberay: dict[str, dict[str, Any]],
) -> None:
    for group, start_params, pod in _ray_pod_templates(kuberay["RayCluster"]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        container = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory", group
        shm_bytes = _bytes(shm["sizeLimit"])
        # Ray's object store shares /dev/shm with the CPU arena: the arena gets what it leaves.
        object_store = int(start_params["object-store-memory"])
        assert shm_bytes >= object_store + 2**30, group
        # tmpfs pages count against the container's memory limit.
        limits = container["resources"]["limits"]
        assert _bytes(limits["memory"]) > shm_bytes, group
        assert container["resources"]["requests"]["memory"] == limits["memory"], group


def test_ray_pods_mount_disk_tier_and_config(kuberay: dict[str, dict[str, Any]]) -> None:
    config_map = kuberay["ConfigMap"]["metadata"]["name"]
    config_dir, config_file = CONFIG_PATH.rsplit("/", 1)
    for group, _, pod in _ray_pod_templates(kuberay["RayCluster"]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        disk = volumes[mounts["/var/lib/kvstore/disk"]]
        assert {"hostPath", "persistentVolumeClaim", "emptyDir"} & set(disk), group
        assert volumes[mounts[config_dir]]["configMap"]["name"] == config_map, group
    assert config_file in kuberay["ConfigMap"]["data"]
    gpu_pod = kuberay["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    gpu_disk = {v["name"]: v for v in gpu_pod["volumes"]}["kvstore-disk"]
    assert "hostPath" in gpu_disk or "persistentVolumeClaim" in gpu_disk, "GPU nodes keep the disk tier on NVMe"


def test_configmap_config_loads_and_matches_the_example(kuberay: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(kuberay["ConfigMap"]["data"]["kvstore.toml"])
    assert load_config(path, env={}) == load_config(ASSETS / "kvstore.toml", env={})


def test_head_exposes_the_router_through_a_service(kuberay: dict[str, dict[str, Any]]) -> None:
    cluster = kuberay["RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ROUTER_PORT in ports.values()
    service = kuberay["Service"]["spec"]
    assert service["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    (port,) = [p for p in service["ports"] if p["port"] == ROUTER_PORT]
    target = port["targetPort"]
    assert (ports[target] if isinstance(target, str) else target) == ROUTER_PORT


def test_rayjob_serves_on_the_cluster(kuberay: dict[str, dict[str, Any]]) -> None:
    job = kuberay["RayJob"]["spec"]
    assert job["entrypoint"] == SERVE_COMMAND
    assert job["clusterSelector"] == {"ray.io/cluster": kuberay["RayCluster"]["metadata"]["name"]}
    assert "rayClusterSpec" not in job, "clusterSelector and rayClusterSpec exclude each other"


# --- container image -------------------------------------------------------------------------------------------------


def test_dockerfile_builds_kvstore_on_python_311_slim() -> None:
    instructions = _dockerfile((ASSETS / "Dockerfile").read_text())
    keywords = [keyword for keyword, _ in instructions]
    args = dict(arg.split("=", 1) for keyword, arg in instructions if keyword == "ARG" and "=" in arg)
    first_from = keywords.index("FROM")
    assert set(keywords[:first_from]) <= {"ARG"}
    base = instructions[first_from][1].replace("${BASE_IMAGE}", args.get("BASE_IMAGE", ""))
    assert base == "python:3.11-slim"
    assert args["TORCH_VERSION"] == "2.13.0"
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu"), "CPU torch by default"
    runs = [arg for keyword, arg in instructions if keyword == "RUN"]
    torch = next(i for i, run in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in run)
    kvstore = next(i for i, run in enumerate(runs) if re.search(r"pip install \.(\s|$)", run))
    assert torch < kvstore, "torch before kvstore, so pip keeps the chosen build"
    assert "gcc" in runs[kvstore] and "import kvstore.tiers._copyrows" in runs[kvstore], "the C copy kernel is built"
    assert any("wget" in run for run in runs), "KubeRay's probes run wget in the Ray container"
    (entrypoint,) = [arg for keyword, arg in instructions if keyword == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["kvstore"]


def test_docker_build_context_leaves_out_local_state() -> None:
    ignored = set((ASSETS / "Dockerfile.dockerignore").read_text().split())
    assert {".git", ".venv"} <= ignored


# --- Prometheus ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    config = _load_yaml("prometheus.yml")
    assert isinstance(config, dict)
    return config


def test_prometheus_scrapes_the_routers_page_only(prometheus: dict[str, Any]) -> None:
    """Every kvstore metric is on the router's page; nothing of kvstore's goes through Ray's metrics agent."""
    (job,) = prometheus["scrape_configs"]
    assert job["job_name"] == "kvstore-router"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for static in job["static_configs"] for t in static["targets"]]
    assert target.endswith(f":{ROUTER_PORT}")
    assert "metric_relabel_configs" not in job and "file_sd_configs" not in job
    for path in (ASSETS / "prometheus.yml", DEPLOY_DOC):
        assert "ray_kvstore" not in path.read_text(), path


# --- metrics reference -----------------------------------------------------------------------------------------------


def test_the_metrics_reference_documents_the_core_families() -> None:
    """The tables parse: a broken table would leave the dashboard checks below checking nothing."""
    assert len(METRIC_LABELS) >= 40
    assert METRIC_LABELS["kvstore_tier_usage_bytes"] == {"node", "medium"}
    assert METRIC_LABELS["kvstore_router_requests_total"] == {"outcome", "code"}
    assert {"kvstore_offload_seconds", "kvstore_router_route_seconds", "kvstore_router_event_lag_seconds"} <= HISTOGRAMS
    for name, documented in _documented_metrics().items():
        assert documented.kind in {"counter", "gauge", "histogram"}, name
        assert name.endswith("_total") == (documented.kind == "counter"), name


def test_every_series_from_more_than_one_process_says_whose_it_is() -> None:
    """The router merges every worker's and tier's page: their series carry replica or node, or they collide."""
    for name, labels in METRIC_LABELS.items():
        if not name.startswith("kvstore_router_"):
            assert labels & {"replica", "node"}, name


# --- Grafana ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    model = json.loads((ASSETS / "grafana-dashboard.json").read_text())
    assert isinstance(model, dict)
    return model


def _graph_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def test_dashboard_is_a_grafana_model(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        assert x >= 0 and x + w <= 24, panel["title"]
        area = {(col, row) for col in range(x, x + w) for row in range(y, y + h)}
        assert not cells & area, f"panel {panel['title']!r} overlaps another"
        cells |= area


def test_every_panel_queries_known_kvstore_metrics(dashboard: dict[str, Any]) -> None:
    panels = _graph_panels(dashboard)
    assert panels
    for panel in panels:
        assert panel["title"] and panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert _balanced(expr), expr
            names = _promql_metrics(expr)
            assert names, f"{panel['title']}: no metric in {expr!r}"
            assert names <= SCRAPED.keys(), f"{panel['title']}: unknown {names - SCRAPED.keys()}"
            labels = set().union(*(SCRAPED[name] for name in names)) | TARGET_LABELS
            assert _promql_grouping_labels(expr) <= labels, f"{panel['title']}: {expr!r}"
            if "histogram_quantile" in expr:
                assert all(name.endswith("_bucket") for name in names), expr


def test_dashboard_has_the_required_panels(dashboard: dict[str, Any]) -> None:
    used = set().union(*(_promql_metrics(t["expr"]) for p in _graph_panels(dashboard) for t in p["targets"]))
    assert used >= REQUIRED_DASHBOARD_METRICS, REQUIRED_DASHBOARD_METRICS - used
    exprs = [t["expr"] for p in _graph_panels(dashboard) for t in p["targets"]]
    hit_rate = re.compile(r"rate\(kvstore_prefix_cache_hits_total\[.*/.*rate\(kvstore_prefix_cache_queries_total\[")
    assert any(hit_rate.search(expr) for expr in exprs), "prefix cache hit rate = rate(hits) / rate(queries)"
    for histogram in HISTOGRAMS:
        assert any("histogram_quantile(0.99, sum by (le" in e and f"{histogram}_bucket" in e for e in exprs), histogram


def test_promql_metric_extraction() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, replica) (rate(kvstore_x_bucket{medium="CPU"}[$__rate_interval])))'
    assert _promql_metrics(expr) == {"kvstore_x_bucket"}
    assert _promql_grouping_labels(expr) == {"le", "replica"}
    assert _promql_metrics("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) and c") == {"a_total", "b_total", "c"}
    assert not _balanced("sum(rate(a[5m])")
