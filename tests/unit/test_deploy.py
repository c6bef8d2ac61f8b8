"""The deployment files agree with the code: Dockerfile, docker compose, Prometheus, Kubernetes.

There is no Docker engine or cluster here, so each file is parsed and checked against what
it names in the code (tests/deploy_checks.py): the ``inferfleet`` commands, options and
environment variables (parsed by click itself), the stream and group of the wire contract,
the console script, the models the image builds, the metrics port, the drain timeouts.
Each check also runs on a copy broken on purpose (``BREAKS``), so every check is shown to
fail on the mistake it is there for. ``docker compose config`` validates the compose files
too where it is installed; CI installs it (.ci/run), and there its absence is a failure.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate as kv
import pytest

from tests import deploy_checks as dc
from tests.conftest import running_in_ci
from tests.keda_schema import SCHEMAS

ROOT = dc.ROOT
K8S = ROOT / "deploy" / "k8s"
# The Secret the manifests read: an example outside deploy/k8s/, which `kubectl apply -f
# deploy/k8s/`
# must never overwrite; the checks resolve the manifests' secretKeyRefs against it.
EXAMPLE_SECRET = ROOT / "deploy" / "examples" / "redis-secret.yaml"


def pyproject_scripts() -> dict[str, str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: what the installed project declares
        from importlib.metadata import distribution

        return {
            e.name: e.value
            for e in distribution("inferfleet").entry_points
            if e.group == "console_scripts"
        }
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def applied_docs() -> list[dict]:
    """What ``kubectl apply -f`` gets from deploy/k8s/ and each variant folder of it."""
    return [d for path in sorted(K8S.rglob("*.y*ml")) for d in dc.load_yaml_all(path)]


def k8s_docs(variant: str) -> list[dict]:
    """The manifests ``kubectl apply`` gets: deploy/k8s/*.yaml, or those with gpu/ replacing
    the Deployment of the same name; plus the example Secret, which the cluster already holds."""
    base = [d for path in sorted(K8S.glob("*.yaml")) for d in dc.load_yaml_all(path)]
    base += dc.load_yaml_all(EXAMPLE_SECRET)
    if variant == "cpu":
        return base
    extra = [d for path in sorted((K8S / variant).glob("*.yaml")) for d in dc.load_yaml_all(path)]
    if variant in (
        "sharded",
        "pipeline",
    ):  # its Deployments and ScaledObjects stand in for the base ones
        replaced = {("Deployment", "inferfleet-worker"), ("ScaledObject", "inferfleet-worker")}
        # each shard or stage scales on its own stream's lag: no scaler for the base queue
        replaced |= {("Deployment", "inferfleet-scaler"), ("Service", "inferfleet-scaler")}
        if variant == "pipeline":  # another queue, with a disruption budget of its own
            replaced.add(("PodDisruptionBudget", "inferfleet-worker"))
    else:
        replaced = {(d["kind"], d["metadata"]["name"]) for d in extra}
    return [d for d in base if (d["kind"], d["metadata"]["name"]) not in replaced] + extra


@pytest.fixture(scope="module")
def files() -> dict[str, Any]:
    compose = dc.interpolate(dc.load_yaml(ROOT / "docker-compose.yml"))
    return {
        "dockerfile": (ROOT / "Dockerfile").read_text(),
        "dockerignore": [
            line.strip()
            for line in (ROOT / ".dockerignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ],
        "compose": compose,
        "compose_gpu": dc.merge_compose(
            compose, dc.interpolate(dc.load_yaml(ROOT / "docker-compose.gpu.yml"))
        ),
        "prometheus": dc.load_yaml(ROOT / "deploy" / "prometheus" / "prometheus.yml"),
        "rules": dc.load_yaml(ROOT / "deploy" / "prometheus" / "alerts.yml"),
        "k8s": k8s_docs("cpu"),
        "k8s_gpu": k8s_docs("gpu"),
        "k8s_sharded": k8s_docs("sharded"),
        "compose_pipeline": dc.merge_compose(
            compose, dc.load_yaml(ROOT / "docker-compose.pipeline.yml")
        ),
        "k8s_pipeline": k8s_docs("pipeline"),
    }


# --------------------------------------------------------------------------- all checks of one kind


def pyproject_package_dirs() -> list[str]:
    """The folders pyproject.toml's package-dir maps the packages to."""
    # its own table of `name = "folder"` lines: no TOML parser needed on Python 3.10
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[tool.setuptools.package-dir]\n", 1)[1].split("\n[", 1)[0]
    return re.findall(r'= "([^"]+)"', table)


def versions_under_test() -> dict[str, str]:
    """torch's and redis-py's versions in this test run (torch's local label, +cpu, dropped)."""
    from importlib.metadata import version

    return {"torch": version("torch").split("+")[0], "redis": version("redis")}


def test_the_dockerfile_pins_the_redis_py_of_constraints_txt(files: dict[str, Any]) -> None:
    # The venv installs with -c constraints.txt, so the two pins must move together: a new
    # redis-py on PyPI then changes neither the tests nor the image until both are bumped.
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    instrs = dc.parse_dockerfile(files["dockerfile"])
    assert dc.pin_problems(instrs, {**versions_under_test(), "redis": pins["redis"]}) == []


def docker_problems(f: dict[str, Any]) -> list[str]:
    instrs = dc.parse_dockerfile(f["dockerfile"])
    models = dc.built_models(instrs)
    return (
        dc.copy_problems(instrs, ROOT, f["dockerignore"])
        + dc.build_steps_problems(instrs)
        + dc.package_copy_problems(instrs, pyproject_package_dirs())
        + dc.runtime_problems(instrs, pyproject_scripts())
        + dc.pin_problems(instrs, versions_under_test())
        + dc.compose_command_problems(f["compose"], models)[0]
        + dc.worker_pod_problems(f["k8s"], models)[0]
    )


def compose_problems(f: dict[str, Any], key: str = "compose") -> list[str]:
    compose, instrs = f[key], dc.parse_dockerfile(f["dockerfile"])
    problems, parsed = dc.compose_command_problems(compose, dc.built_models(instrs))
    return (
        problems
        + dc.redis_service_problems(compose)
        + dc.redis_url_problems(compose)
        + dc.loopback_problems(compose)
        + dc.metrics_problems(compose, parsed, f["prometheus"])
        + dc.grace_problems(compose, parsed)
        + dc.prometheus_problems(compose, f["prometheus"], f["rules"], ROOT)
    )


def gpu_compose_problems(f: dict[str, Any]) -> list[str]:
    return compose_problems(f, "compose_gpu") + dc.gpu_problems(
        f["compose_gpu"], dc.parse_dockerfile(f["dockerfile"])
    )


def k8s_problems(f: dict[str, Any], key: str = "k8s") -> list[str]:
    docs = f[key]
    problems, parsed = dc.worker_pod_problems(
        docs, dc.built_models(dc.parse_dockerfile(f["dockerfile"]))
    )
    return (
        problems
        + dc.selector_problems(docs)
        + dc.keda_problems(docs, parsed)
        + dc.scaler_problems(docs, parsed)
        + dc.grace_period_problems(docs)
        + dc.liveness_problems(docs)
    )


def gpu_k8s_problems(f: dict[str, Any]) -> list[str]:
    return k8s_problems(f, "k8s_gpu") + dc.gpu_pod_problems(f["k8s_gpu"])


def sharded_k8s_problems(f: dict[str, Any]) -> list[str]:
    docs = f["k8s_sharded"]
    _, parsed = dc.worker_pod_problems(docs, dc.built_models(dc.parse_dockerfile(f["dockerfile"])))
    return k8s_problems(f, "k8s_sharded") + dc.shard_problems(parsed)


def pipeline_compose_problems(f: dict[str, Any]) -> list[str]:
    problems = compose_problems(f, "compose_pipeline")
    models = dc.built_models(dc.parse_dockerfile(f["dockerfile"]))
    _, parsed = dc.compose_command_problems(f["compose_pipeline"], models)
    splits = {name: params for name, params in parsed.items() if "split_at" in params}
    return problems + dc.pipeline_problems(splits, parsed)


def pipeline_k8s_problems(f: dict[str, Any]) -> list[str]:
    docs, models = f["k8s_pipeline"], dc.built_models(dc.parse_dockerfile(f["dockerfile"]))
    _, parsed = dc.worker_pod_problems(docs, models)
    found, splits = dc.split_job_problems(docs, models)
    return k8s_problems(f, "k8s_pipeline") + found + dc.pipeline_problems(splits, parsed)


# --------------------------------------------------------------------------- the real files


def test_the_dockerfile_builds_what_the_services_run(files: dict[str, Any]) -> None:
    assert docker_problems(files) == []
    assert dc.built_models(dc.parse_dockerfile(files["dockerfile"])) >= {"/app/models/ctr.pt"}


def test_compose_commands_env_redis_metrics_and_grace_agree_with_the_code(
    files: dict[str, Any],
) -> None:
    assert compose_problems(files) == []
    assert set(files["compose"]["services"]) >= {"redis", "supervisor", "producer", "prometheus"}


def test_the_compose_gpu_override_reserves_nvidia_gpus_and_stays_valid(
    files: dict[str, Any],
) -> None:
    assert gpu_compose_problems(files) == []
    env = dc.env_of(files["compose_gpu"]["services"]["supervisor"])
    assert env["INFERFLEET_DEVICES"] == "auto" and env["REDIS_URL"] == "redis://redis:6379/0"
    # one worker per GPU: per device 1, and no cap below the GPU count (empty: the default)
    assert env["INFERFLEET_WORKERS_PER_DEVICE"] == "1" and env["INFERFLEET_MAX_WORKERS"] == ""
    _, parsed = dc.compose_command_problems(files["compose_gpu"], {"/app/models/ctr.pt"})
    assert (
        parsed["supervisor"]["max_workers"] is None
        and parsed["supervisor"]["workers_per_device"] == 1
    )


def test_applying_deploy_k8s_creates_no_secret() -> None:
    assert dc.secret_problems(applied_docs()) == []
    assert dc.secret_problems(dc.load_yaml_all(EXAMPLE_SECRET)) != []  # the check sees a Secret


@pytest.mark.parametrize(
    ("beat_age_s", "loop_age_s", "alive"),
    [(1, 1, True), (1, 59, True), (1, 61, False), (61, 1, False), (None, None, False)],
)
def test_the_liveness_probe_fails_on_a_stale_heartbeat_or_loop(
    files: dict[str, Any],
    tmp_path: Path,
    beat_age_s: float | None,
    loop_age_s: float | None,
    alive: bool,
) -> None:
    """The manifest's own probe command, run on heartbeat files of known ages (None: no file)."""
    import json
    import sys
    import time

    path = tmp_path / "heartbeat.json"
    if beat_age_s is not None:
        now_ms = time.time() * 1000
        path.write_text(
            json.dumps(
                {"last_seen_ms": now_ms - beat_age_s * 1000, "loop_ms": now_ms - loop_age_s * 1000}
            )
        )
    argv = dc.liveness_command(files["k8s"])
    assert argv[0] == "python"
    out = subprocess.run(
        [sys.executable, *argv[1:]],
        env={"INFERFLEET_HEARTBEAT_FILE": str(path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (out.returncode == 0) == alive, out.stderr


def test_kubernetes_worker_keda_pdb_and_grace_agree_with_the_code(files: dict[str, Any]) -> None:
    assert k8s_problems(files) == []
    kinds = {d["kind"] for d in files["k8s"]}
    assert kinds == {
        "Deployment",
        "Service",
        "ScaledObject",
        "TriggerAuthentication",
        "PodDisruptionBudget",
        "Secret",
    }
    scaler = files["k8s"]
    assert [d for d in scaler if d["kind"] == "Deployment" and dc.is_scaler(d)]


def test_the_sharded_variant_scales_each_shard_on_its_own_stream(files: dict[str, Any]) -> None:
    assert sharded_k8s_problems(files) == []
    streams = sorted(
        so["spec"]["triggers"][0]["metadata"]["stream"]
        for so in dc.by_kind(files["k8s_sharded"], "ScaledObject").values()
    )
    assert streams == ["inferfleet:{ctr.0}:requests", "inferfleet:{ctr.1}:requests"]
    assert len(dc.by_kind(files["k8s_sharded"], "Deployment")) == 2


def test_the_compose_pipeline_override_splits_once_and_supervises_each_stage(
    files: dict[str, Any],
) -> None:
    assert pipeline_compose_problems(files) == []
    services = files["compose_pipeline"]["services"]
    stages = sorted(dc.env_of(services[name])["INFERFLEET_STAGE"] for name in ("stage0", "stage1"))
    assert stages == ["0", "1"]
    assert (
        services["stage1"]["depends_on"]["split"]["condition"] == "service_completed_successfully"
    )


def test_the_kubernetes_pipeline_scales_each_stage_on_its_own_stream(files: dict[str, Any]) -> None:
    assert pipeline_k8s_problems(files) == []
    streams = sorted(
        so["spec"]["triggers"][0]["metadata"]["stream"]
        for so in dc.by_kind(files["k8s_pipeline"], "ScaledObject").values()
    )
    assert streams == ["inferfleet:{stack}:requests", "inferfleet:{stack}:stage:1"]
    assert len(dc.by_kind(files["k8s_pipeline"], "Deployment")) == 2 and dc.by_kind(
        files["k8s_pipeline"], "Job"
    )


def test_the_kubernetes_gpu_variant_replaces_the_cpu_deployment(files: dict[str, Any]) -> None:
    assert gpu_k8s_problems(files) == []
    deployments = dc.by_kind(files["k8s_gpu"], "Deployment")
    assert deployments.keys() == dc.by_kind(files["k8s"], "Deployment").keys()
    assert deployments != dc.by_kind(files["k8s"], "Deployment")  # the GPU one replaced the CPU one


def test_parse_duration_reads_compose_durations() -> None:
    assert dc.parse_duration_s("45s") == 45
    assert dc.parse_duration_s("1m30s") == 90
    assert dc.parse_duration_s("1500ms") == 1.5
    with pytest.raises(ValueError):
        dc.parse_duration_s("45 seconds")


# --------------------------------------------------------------------------- each check can fail


def at(data: Any, path: tuple) -> Any:
    """Walk ``path``: dict keys, list indices, ``Kind/name`` (a manifest), ``name=X`` (a list
    item)."""
    for step in path:
        if isinstance(step, str) and "/" in step and isinstance(data, list):
            kind, name = step.split("/", 1)
            data = next(d for d in data if d["kind"] == kind and d["metadata"]["name"] == name)
        elif isinstance(step, str) and step.startswith("name=") and isinstance(data, list):
            data = next(d for d in data if d.get("name") == step[5:])
        else:
            data = data[step]
    return data


def put(path: tuple, value: Any) -> Callable[[Any], None]:
    return lambda data: at(data, path[:-1]).__setitem__(path[-1], value)


def drop(path: tuple) -> Callable[[Any], None]:
    return lambda data: at(data, path[:-1]).pop(path[-1])


def rename(path: tuple, new: str) -> Callable[[Any], None]:
    def apply(data: Any) -> None:
        parent = at(data, path[:-1])
        parent[new] = parent.pop(path[-1])

    return apply


def edit(old: str, new: str) -> Callable[[str], str]:
    def apply(text: str) -> str:
        assert old in text, f"{old!r} is not in the file any more: update this break"
        return text.replace(old, new)

    return apply


STAGE1_ARGS = (
    "Deployment/inferfleet-stack-stage1",
    "spec",
    "template",
    "spec",
    "containers",
    0,
    "args",
)
STAGE1_TRIGGER = ("ScaledObject/inferfleet-stack-stage1", "spec", "triggers", 0)
SUP = ("services", "supervisor")
SUP_ENV = (*SUP, "environment")
REDIS = ("services", "redis")
POD = ("Deployment/inferfleet-worker", "spec", "template")
CONTAINER = (*POD, "spec", "containers", 0)
ENV = (*CONTAINER, "env")
TRIGGER = ("ScaledObject/inferfleet-worker", "spec", "triggers", 1, "metadata")  # pending
READER = ("ScaledObject/inferfleet-worker", "spec", "triggers", 0, "metadata")  # the scaler's
SCALER = ("Deployment/inferfleet-scaler", "spec", "template", "spec", "containers", 0)
SHARD1 = ("Deployment/inferfleet-worker-s1", "spec", "template", "spec", "containers", 0, "args")
SHARD1_TRIGGER = ("ScaledObject/inferfleet-worker-s1", "spec", "triggers", 0)

#: (what breaks, which files, the mutation, a phrase of the problem it must raise)
BREAKS: list[tuple[str, str, Callable, str]] = [
    # compose: commands, options and environment variables
    ("subcommand typo", "compose", put((*SUP, "command"), ["supervize"]), "no command 'supervize'"),
    (
        "option typo",
        "compose",
        put((*SUP, "command"), ["supervise", "--metrics-prot", "9100"]),
        "has no option --metrics-prot",
    ),
    (
        "env typo",
        "compose",
        rename((*SUP_ENV, "INFERFLEET_MAX_WORKERS"), "INFERFLEET_MAX_WORKER"),
        "INFERFLEET_MAX_WORKER is not the variable of any option of inferfleet supervise",
    ),
    (
        "env of another command",
        "compose",
        put(("services", "producer", "environment", "INFERFLEET_DRAIN_TIMEOUT_S"), "30"),
        "is not the variable of any option of inferfleet bench",
    ),
    (
        "env value click rejects",
        "compose",
        put((*SUP_ENV, "INFERFLEET_MAX_WORKERS"), "four"),
        "Invalid value",
    ),
    (
        "env value WorkerSettings rejects",
        "compose",
        put((*SUP_ENV, "INFERFLEET_METRICS_PORT"), "70000"),
        "metrics_port must be",
    ),
    (
        "required option missing",
        "compose",
        drop((*SUP_ENV, "INFERFLEET_MODEL")),
        "Missing option '--model'",
    ),
    (
        "model not in the image",
        "compose",
        put((*SUP_ENV, "INFERFLEET_MODEL"), "/app/models/resnet50.pt"),
        "is not built into the image",
    ),
    # compose: Redis
    (
        "REDIS_URL host",
        "compose",
        put((*SUP_ENV, "REDIS_URL"), "redis://cache:6379/0"),
        "is not the compose Redis",
    ),
    (
        "Redis evicts",
        "compose",
        put((*REDIS, "command", 8), "allkeys-lru"),
        "lacks --maxmemory-policy noeviction",
    ),
    ("Redis without AOF", "compose", put((*REDIS, "command", 2), "no"), "lacks --appendonly yes"),
    ("Redis without healthcheck", "compose", drop((*REDIS, "healthcheck")), "lacks a healthcheck"),
    (
        "Redis without volume",
        "compose",
        put((*REDIS, "volumes"), ["elsewhere:/data"]),
        "lacks a named volume",
    ),
    ("Redis 6", "compose", put((*REDIS, "image"), "redis:6"), "lacks image redis:7"),
    # compose: metrics, Prometheus, grace
    (
        "metrics port",
        "compose",
        put((*SUP_ENV, "INFERFLEET_METRICS_PORT"), "9101"),
        "metrics port 9101, not 9100",
    ),
    ("published port", "compose", put((*SUP, "ports"), ["9101:9101"]), "is not in its ports"),
    (
        "published on every interface",
        "compose",
        put((*SUP, "ports"), ["9100:9100"]),
        "is not published on 127.0.0.1",
    ),
    (
        "Prometheus target",
        "compose",
        put(
            ("prometheus", "scrape_configs", 0, "static_configs", 0, "targets"), ["supervisor:9101"]
        ),
        "does not scrape supervisor:9100",
    ),
    (
        "Prometheus mount",
        "compose",
        put(("services", "prometheus", "volumes", 0), "./deploy/prom:/etc/prometheus:ro"),
        "is not mounted from the repository",
    ),
    (
        "alert on an unknown metric",
        "compose",
        put(("rules", "groups", 0, "rules", 0, "expr"), "max(inferfleet_queue_lags) > 1"),
        "not an agreed metric",
    ),
    (
        "no lag alert",
        "compose",
        put(("rules", "groups", 0, "rules", 0, "expr"), "max(inferfleet_queue_pending) > 1"),
        "no alert on inferfleet_queue_lag",
    ),
    (
        "no error-rate alert",
        "compose",
        put(
            ("rules", "groups", 0, "rules", 1, "expr"),
            'rate(inferfleet_requests_total{code="model_error"}[5m]) > 1',
        ),
        "no alert on the error rate",
    ),
    (
        "healthcheck ignores the model",
        "compose",
        put(
            (*SUP, "healthcheck", "test", 3),
            "import urllib.request as u; u.urlopen('http://127.0.0.1:9100/metrics')",
        ),
        "healthcheck does not read inferfleet_model_info",
    ),
    (
        "grace shorter than the drain",
        "compose",
        put((*SUP, "stop_grace_period"), "20s"),
        "does not exceed the drain timeout 30",
    ),
    (
        "drain timeout left at its default",
        "compose",
        drop((*SUP_ENV, "INFERFLEET_DRAIN_TIMEOUT_S")),
        "does not exceed the drain timeout 60",
    ),
    # compose GPU override
    (
        "GPU driver",
        "compose_gpu",
        put((*SUP, "deploy", "resources", "reservations", "devices", 0, "driver"), "amd"),
        "no service reserves a device with driver nvidia",
    ),
    (
        "GPU build arg typo",
        "compose_gpu",
        rename((*SUP, "build", "args", "TORCH_INDEX_URL"), "TORCH_INDEX"),
        "build arg TORCH_INDEX is not an ARG",
    ),
    (
        "GPU image with the CPU ONNX Runtime",
        "compose_gpu",
        put((*SUP, "build", "args", "ONNX_EXTRA"), "onnx"),
        "a CUDA build without ONNX_EXTRA: gpu",
    ),
    (
        "GPU env typo",
        "compose_gpu",
        rename((*SUP_ENV, "INFERFLEET_DEVICES"), "INFERFLEET_DEVICE"),
        "INFERFLEET_DEVICE is not the variable of any option of inferfleet supervise",
    ),
    # Kubernetes: the worker pod
    (
        "pod runs the supervisor",
        "k8s",
        put((*CONTAINER, "args"), ["supervise", "--metrics-port", "9100"]),
        "each pod must run one `inferfleet worker`",
    ),
    (
        "pod option typo",
        "k8s",
        put((*CONTAINER, "args"), ["worker", "--metric-port", "9100"]),
        "has no option --metric-port",
    ),
    (
        "pod env of supervise",
        "k8s",
        put((*ENV, "name=INFERFLEET_DEVICE", "name"), "INFERFLEET_DEVICES"),
        "INFERFLEET_DEVICES is not the variable of any option of inferfleet worker",
    ),
    (
        "pod env read by nobody",
        "k8s",
        put((*ENV, "name=REDIS_ADDRESS", "name"), "REDIS_ADRESS"),
        "REDIS_ADRESS is read by neither inferfleet nor KEDA",
    ),
    (
        "Secret key typo",
        "k8s",
        put((*ENV, "name=REDIS_URL", "valueFrom", "secretKeyRef", "key"), "uri"),
        "no Secret 'inferfleet-redis' with key 'uri'",
    ),
    (
        "containerPort",
        "k8s",
        put((*CONTAINER, "ports", 0, "containerPort"), 9101),
        "containerPort 'metrics'",
    ),
    (
        "scrape annotation",
        "k8s",
        put((*POD, "metadata", "annotations", "prometheus.io/port"), "9000"),
        "annotation prometheus.io/port",
    ),
    (
        "no liveness probe",
        "k8s",
        drop((*CONTAINER, "livenessProbe")),
        "livenessProbe does not read the heartbeat",
    ),
    (
        "no heartbeat file",
        "k8s",
        lambda d: at(d, ENV).remove(at(d, (*ENV, "name=INFERFLEET_HEARTBEAT_FILE"))),
        "no INFERFLEET_HEARTBEAT_FILE",
    ),
    ("no startup probe", "k8s", drop((*CONTAINER, "startupProbe")), "startupProbe does not read"),
    (
        "readiness probe port",
        "k8s",
        put(
            (*CONTAINER, "readinessProbe", "exec", "command", 2),
            "import urllib.request as u; u.urlopen('http://127.0.0.1:9000/metrics')",
        ),
        "readinessProbe does not read inferfleet_model_info from 127.0.0.1:9100/metrics",
    ),
    (
        "no memory limit",
        "k8s",
        drop((*CONTAINER, "resources", "limits", "memory")),
        "no resources.limits.memory",
    ),
    (
        "grace shorter than the drain",
        "k8s",
        put((*POD, "spec", "terminationGracePeriodSeconds"), 20),
        "terminationGracePeriodSeconds 20",
    ),
    ("no preStop", "k8s", drop((*CONTAINER, "lifecycle")), "no preStop"),
    # Kubernetes: selectors
    (
        "Deployment selector",
        "k8s",
        put(
            (
                "Deployment/inferfleet-worker",
                "spec",
                "selector",
                "matchLabels",
                "inferfleet.io/queue",
            ),
            "ranker",
        ),
        "its selector does not match",
    ),
    (
        "PDB selector",
        "k8s",
        put(
            (
                "PodDisruptionBudget/inferfleet-worker",
                "spec",
                "selector",
                "matchLabels",
                "app.kubernetes.io/component",
            ),
            "workers",
        ),
        "matches no worker pod",
    ),
    (
        "scale target",
        "k8s",
        put(
            ("ScaledObject/inferfleet-worker", "spec", "scaleTargetRef", "name"),
            "inferfleet-workers",
        ),
        "is no Deployment here",
    ),
    # Kubernetes: KEDA
    (
        "stream without hash tag",
        "k8s",
        put((*TRIGGER, "stream"), "inferfleet:ctr:requests"),
        "stream is 'inferfleet:ctr:requests', not 'inferfleet:{ctr}:requests'",
    ),
    (
        "queue renamed in the pod only",
        "k8s",
        put((*ENV, "name=INFERFLEET_NAME", "value"), "ranker"),
        "not 'inferfleet:{ranker}:requests'",
    ),
    (
        "consumer group",
        "k8s",
        put((*TRIGGER, "consumerGroup"), "worker"),
        "consumerGroup is 'worker'",
    ),
    (
        "pendingEntriesCount as a number",
        "k8s",
        put((*TRIGGER, "pendingEntriesCount"), 64),
        "pendingEntriesCount must be a string",
    ),
    (
        "pendingEntriesCount not a batch",
        "k8s",
        put((*TRIGGER, "pendingEntriesCount"), "10"),
        "pendingEntriesCount '10' is under one batch (64 rows)",
    ),
    (
        "lagCount",
        "k8s_sharded",
        put((*SHARD1_TRIGGER, "metadata", "lagCount"), "100"),
        "lagCount is '100', not '50'",
    ),
    (
        "no activationLagCount",
        "k8s_sharded",
        drop((*SHARD1_TRIGGER, "metadata", "activationLagCount")),
        "no activationLagCount",
    ),
    # Kubernetes: the scaler KEDA reads
    (
        "scaler URL unqualified",
        "k8s",
        put((*READER, "url"), "http://inferfleet-scaler:9200/desired"),
        "metrics-api url is",
    ),
    ("scaler value", "k8s", put((*READER, "valueLocation"), "count"), "valueLocation is 'count'"),
    ("activation at zero", "k8s", put((*READER, "activationTargetValue"), "0"), "must lie in"),
    (
        "replicas not the scaler's",
        "k8s",
        put(("ScaledObject/inferfleet-worker", "spec", "maxReplicaCount"), 8),
        "are not the scaler's --min-workers/--max-workers",
    ),
    (
        "no reader",
        "k8s",
        drop(("ScaledObject/inferfleet-worker", "spec", "triggers", 0)),
        "no metrics-api",
    ),
    (
        "scaler option",
        "k8s",
        put((*SCALER, "args"), ["scaler", "--prot", "9200"]),
        "no option --prot",
    ),
    (
        "scaler port not served",
        "k8s",
        put(("Service/inferfleet-scaler", "spec", "ports", 0, "port"), 9300),
        "no Service selects its pod on port 9200",
    ),
    (
        "scaler probe",
        "k8s",
        put((*SCALER, "livenessProbe", "httpGet", "path"), "/desired"),
        "livenessProbe does not GET /healthz",
    ),
    (
        "scaler on another queue",
        "k8s",
        put((*SCALER, "env", "name=INFERFLEET_NAME", "value"), "ranker"),
        "no worker Deployment serves queue 'ranker'",
    ),
    (
        "scaler policy out of range",
        "k8s",
        put((*SCALER, "env", "name=INFERFLEET_TARGET_P99_MS", "value"), "-5"),
        "target_p99_ms",
    ),
    (
        "pollingInterval",
        "k8s",
        put(("ScaledObject/inferfleet-worker", "spec", "pollingInterval"), 30),
        "pollingInterval 30",
    ),
    (
        "KEDA address",
        "k8s",
        put(("Secret/inferfleet-redis", "stringData", "address"), "other:6379"),
        "KEDA's address 'other:6379'",
    ),
    (
        "KEDA password",
        "k8s",
        put(("Secret/inferfleet-redis", "stringData", "password"), "other"),
        "password is not REDIS_URL's",
    ),
    (
        "TriggerAuthentication parameter",
        "k8s",
        put(
            ("TriggerAuthentication/inferfleet-redis", "spec", "secretTargetRef", 0, "parameter"),
            "passwd",
        ),
        "no TriggerAuthentication with a password",
    ),
    # Kubernetes sharded variant
    (
        "two workers on one shard",
        "k8s_sharded",
        put(
            SHARD1,
            ["worker", "--metrics-port", "9100", "--shards", "2", "--shard", "0", "--cluster"],
        ),
        "serve shards [0, 0], not each shard once",
    ),
    (
        "shard counts disagree",
        "k8s_sharded",
        put(
            SHARD1,
            ["worker", "--metrics-port", "9100", "--shards", "3", "--shard", "1", "--cluster"],
        ),
        "disagree on --shards",
    ),
    (
        "shard without --cluster",
        "k8s_sharded",
        put(SHARD1, ["worker", "--metrics-port", "9100", "--shards", "2", "--shard", "1"]),
        "needs --cluster",
    ),
    (
        "scaled on another shard's stream",
        "k8s_sharded",
        put((*SHARD1_TRIGGER, "metadata", "stream"), "inferfleet:{ctr.0}:requests"),
        "stream is 'inferfleet:{ctr.0}:requests', not 'inferfleet:{ctr.1}:requests'",
    ),
    (
        "single-node scaler on a cluster",
        "k8s_sharded",
        put((*SHARD1_TRIGGER, "type"), "redis-streams"),
        "not one redis-cluster-streams trigger",
    ),
    (
        "cluster addresses without REDIS_URL's node",
        "k8s_sharded",
        put(("Secret/inferfleet-redis", "stringData", "addresses"), "other:6379"),
        "do not hold REDIS_URL's",
    ),
    # pipelines: compose override and Kubernetes
    (
        "a stage served twice, one not at all",
        "k8s_pipeline",
        put(
            STAGE1_ARGS,
            ["worker", "--metrics-port", "9100", "--pipeline", "/pipelines/stack", "--stage", "0"],
        ),
        "stages [0] are served, the split /pipelines/stack has [0, 1]",
    ),
    (
        "a stage scaled on the request stream",
        "k8s_pipeline",
        put((*STAGE1_TRIGGER, "metadata", "stream"), "inferfleet:{stack}:requests"),
        "stream is 'inferfleet:{stack}:requests', not 'inferfleet:{stack}:stage:1'",
    ),
    (
        "a stage of a split nobody writes",
        "compose_pipeline",
        put(("services", "stage1", "environment", "INFERFLEET_MODEL"), "/elsewhere"),
        "which no `inferfleet split --out` writes",
    ),
    (
        "a split of a model the image lacks",
        "k8s_pipeline",
        put(
            ("Job/inferfleet-split-stack", "spec", "template", "spec", "containers", 0, "args", 4),
            "/app/x.npy",
        ),
        "example /app/x.npy is not built into the image",
    ),
    # Kubernetes GPU variant
    (
        "GPU pod without a GPU",
        "k8s_gpu",
        drop((*CONTAINER, "resources", "limits", "nvidia.com/gpu")),
        "no resources.limits nvidia.com/gpu",
    ),
    # Dockerfile
    (
        "COPY of a missing path",
        "dockerfile",
        edit("COPY producer ./producer", "COPY produce ./producer"),
        "COPY produce: no such file",
    ),
    (
        "COPY of an ignored path",
        "dockerfile",
        edit("COPY worker ./worker", "COPY worker ./worker\nCOPY tests/unit ./tests/unit"),
        "COPY tests/unit: excluded by .dockerignore",
    ),
    (
        "entrypoint",
        "dockerfile",
        edit('ENTRYPOINT ["inferfleet"]', 'ENTRYPOINT ["inferfleet-cli"]'),
        'ENTRYPOINT is not ["inferfleet"]',
    ),
    (
        "package root not copied",
        "dockerfile",
        edit("COPY inferfleet ./inferfleet\n", ""),
        "the package folder inferfleet is not copied",
    ),
    (
        "install without the worker side",
        "dockerfile",
        edit('".[worker,${ONNX_EXTRA}]"', "."),
        'no RUN pip install ".[worker,${ONNX_EXTRA}]"',
    ),
    ("root user", "dockerfile", edit("USER inferfleet", "USER root"), "runs as root"),
    (
        "stop signal",
        "dockerfile",
        edit("STOPSIGNAL SIGTERM", "STOPSIGNAL SIGKILL"),
        "STOPSIGNAL is not SIGTERM",
    ),
    ("exposed port", "dockerfile", edit("EXPOSE 9100", "EXPOSE 9000"), "9100 is not EXPOSEd"),
    (
        "base image",
        "dockerfile",
        edit("ARG PYTHON_IMAGE=python:3.11-slim", "ARG PYTHON_IMAGE=python:3.12"),
        "not FROM python:3.11-slim",
    ),
    (
        "torch not pinned",
        "dockerfile",
        edit('ARG TORCH_SPEC="torch==', 'ARG TORCH_SPEC="torch>='),
        "not 'torch==",
    ),
    (
        "redis-py not pinned",
        "dockerfile",
        edit('"${REDIS_SPEC}" ', ""),
        "no RUN pip install uses ${REDIS_SPEC}",
    ),
    (
        "no ONNX Runtime",
        "dockerfile",
        edit('".[worker,${ONNX_EXTRA}]"', '".[worker]"'),
        'no RUN pip install ".[worker,${ONNX_EXTRA}]"',
    ),
    (
        "the GPU build of ONNX Runtime by default",
        "dockerfile",
        edit("ARG ONNX_EXTRA=onnx", "ARG ONNX_EXTRA=gpu"),
        "ARG ONNX_EXTRA does not default to onnx",
    ),
    (
        "CUDA torch by default",
        "dockerfile",
        edit("whl/cpu", "whl/cu126"),
        "does not default to the PyTorch CPU",
    ),
    (
        "models elsewhere",
        "dockerfile",
        edit("--out /app/models", "--out /models"),
        "is not built into the image",
    ),
    (
        "models not built",
        "dockerfile",
        edit("COPY tests/fixtures/build_models.py ./tests/fixtures/build_models.py\n", ""),
        "tests/fixtures/build_models.py is not copied",
    ),
]

CHECKS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "compose": compose_problems,
    "compose_gpu": gpu_compose_problems,
    "k8s": k8s_problems,
    "k8s_gpu": gpu_k8s_problems,
    "k8s_sharded": sharded_k8s_problems,
    "dockerfile": docker_problems,
    "compose_pipeline": pipeline_compose_problems,
    "k8s_pipeline": pipeline_k8s_problems,
}


@pytest.mark.parametrize(("what", "key", "mutate", "expected"), BREAKS, ids=[b[0] for b in BREAKS])
def test_each_check_fails_on_the_mistake_it_guards(
    files: dict[str, Any], what: str, key: str, mutate: Callable, expected: str
) -> None:
    broken = copy.deepcopy(files)
    if key == "dockerfile":
        broken["dockerfile"] = mutate(broken["dockerfile"])
    else:
        _mutate_files(broken, key, mutate)
    problems = CHECKS[key](broken)
    assert any(expected in p for p in problems), problems


def _mutate_files(files: dict[str, Any], target: str, mutate: Callable) -> None:
    """Apply a mutation whose path starts in the compose file, Prometheus' files or the
    manifests."""
    view = files[target]
    if isinstance(view, dict):  # compose: let paths reach prometheus.yml and alerts.yml too
        view = {**view, "prometheus": files["prometheus"], "rules": files["rules"]}
    mutate(view)


# --------------------------------------------------------------------------- docker compose's own
# validator


def _compose_cli() -> list[str] | None:
    """``docker compose`` (v2 plugin) if it works, else Debian/PyPI ``docker-compose`` (v1)."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def test_docker_compose_config_accepts_the_compose_files() -> None:
    cli = _compose_cli()
    if cli is None:
        if running_in_ci():
            pytest.fail("no docker compose validator: .ci/run installs docker-compose")
        pytest.skip("no `docker compose` or `docker-compose` here (CI installs one)")
    for extra in ([], ["-f", "docker-compose.gpu.yml"]):
        out = subprocess.run(
            [*cli, "-f", "docker-compose.yml", *extra, "config", "-q"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
    broken = subprocess.run(
        [*cli, "-f", "-", "config", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        input="services:\n  redis:\n    image: redis:7\n    stop_grace_priod: 45s\n",
    )
    assert broken.returncode != 0 and "stop_grace_priod" in broken.stdout + broken.stderr, (
        "the validator accepted a misspelt key: it validates nothing"
    )


# --------------------------------------------------------------------------- the Kubernetes schemas

#: Kubernetes' own objects validate against the schemas kubernetes-validate (PyPI) ships, strict
#: (no unknown field). KEDA's ScaledObject and TriggerAuthentication are custom resources: no
#: schema of theirs is installable here (kubeconform and the CRDs' JSON schemas are downloads),
#: so the structural checks above are all they get.
CUSTOM_API_GROUPS = ("keda.sh/",)


def schema_docs() -> list[dict]:
    return applied_docs() + dc.load_yaml_all(EXAMPLE_SECRET)


def test_the_manifests_validate_against_the_kubernetes_schemas() -> None:
    checked = set()
    for doc in schema_docs():
        if not doc["apiVersion"].startswith(CUSTOM_API_GROUPS):
            kv.validate(doc, kv.latest_version(), strict=True)
            checked.add(doc["kind"])
    assert checked == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "Secret",
        "Job",
        "PersistentVolumeClaim",
    }


@pytest.mark.parametrize(
    ("what", "mutate"),
    [
        (
            "misspelt field",
            rename(("spec", "template", "spec", "containers", 0, "livenessProbe"), "livenesProbe"),
        ),
        (
            "a number as a string",
            put(("spec", "template", "spec", "terminationGracePeriodSeconds"), "60"),
        ),
        (
            "a probe command as a mapping",
            put(
                (
                    "spec",
                    "template",
                    "spec",
                    "containers",
                    0,
                    "livenessProbe",
                    "exec",
                    "command",
                    2,
                ),
                {"sys.exit(f'hung": "x'"},
            ),
        ),
    ],
)
def test_the_schema_validation_rejects_a_broken_deployment(what: str, mutate: Callable) -> None:
    deployment = copy.deepcopy(
        next(d for d in dc.load_yaml_all(K8S / "worker.yaml") if d["kind"] == "Deployment")
    )
    mutate(deployment)
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)


# --------------------------------------------------------------------------- KEDA's schemas


def keda_docs() -> list[dict]:
    return [d for d in applied_docs() if d["apiVersion"].startswith(CUSTOM_API_GROUPS)]


def keda_schema_problems(doc: dict) -> list[str]:
    """What KEDA's CRD schema (tests/keda_schema.py) and, for the HPA behaviour inside it,
    Kubernetes' own HorizontalPodAutoscaler schema refuse in ``doc``."""
    validator = jsonschema.Draft7Validator(SCHEMAS[doc["kind"]])
    problems = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    hpa = ((doc["spec"].get("advanced") or {}).get("horizontalPodAutoscalerConfig")) or {}
    if "behavior" in hpa:
        wrapped = {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": doc["metadata"]["name"]},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
                "maxReplicas": 1,
                "behavior": hpa["behavior"],
            },
        }
        try:
            kv.validate(wrapped, kv.latest_version(), strict=True)
        except kv.ValidationError as exc:
            problems.append(f"behavior: {exc}")
    return problems


def test_the_keda_objects_meet_keda_s_schema() -> None:
    docs = keda_docs()
    assert {d["kind"] for d in docs} == {"ScaledObject", "TriggerAuthentication"}
    assert {d["metadata"]["name"]: keda_schema_problems(d) for d in docs} == {
        d["metadata"]["name"]: [] for d in docs
    }


@pytest.mark.parametrize(
    ("what", "mutate", "expected"),
    [
        (
            "misspelt field",
            rename(("spec", "pollingInterval"), "pollingIntervall"),
            "pollingIntervall",
        ),
        ("unquoted metadata", put(("spec", "triggers", 0, "metadata", "targetValue"), 1), "string"),
        ("no triggers", drop(("spec", "triggers")), "'triggers' is a required property"),
        (
            "a misspelt HPA policy",
            put(
                ("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleUp"),
                {"polices": []},
            ),
            "behavior",
        ),
    ],
)
def test_the_keda_schema_refuses_a_broken_scaled_object(
    what: str, mutate: Callable, expected: str
) -> None:
    scaled = copy.deepcopy(
        next(d for d in dc.load_yaml_all(K8S / "keda.yaml") if d["kind"] == "ScaledObject")
    )
    mutate(scaled)
    assert any(expected in p for p in keda_schema_problems(scaled))
