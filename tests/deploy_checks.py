"""Pure checks of the deployment files against the code, for tests/unit/test_deploy.py.

Every check takes already-parsed files (dicts from YAML, Dockerfile instructions) and
returns a list of problems, one readable line each; an empty list means the files agree
with the code. The tests run each check on the real files (no problems) and on a copy
broken on purpose (the expected problem), so every check is shown able to fail.

What the files are checked against, never copied from:

* ``inferfleet.worker.cli.main``: each ``inferfleet`` subcommand, ``--option`` and INFERFLEET_* /
  REDIS_URL variable, parsed by click itself (``make_context``) and then validated by
  ``WorkerSettings`` for the commands that run a worker;
* ``inferfleet.producer.protocol``: the stream name (``QueueKeys(name, prefix).requests``) and the
  consumer group (``GROUP``) that KEDA watches;
* ``pyproject.toml``: the console script the image's ENTRYPOINT runs;
* ``tests/fixtures/build_models.py``: the models the image builds.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import click
import yaml

from inferfleet.producer.errors import ProtocolError
from inferfleet.producer.protocol import DEFAULT_PREFIX, GROUP, shard_keys
from inferfleet.worker.cli import main
from inferfleet.worker.cli.supervise import policy_settings
from inferfleet.worker.config import WorkerSettings
from inferfleet.worker.errors import ConfigError
from inferfleet.worker.keys import stage_keys
from inferfleet.worker.metrics import metric_names

ROOT = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = "inferfleet"
METRICS_PORT = 9100  # the agreed port: compose supervisor and each Kubernetes worker pod
# What a worker needs after SIGTERM in the worst case we plan for: the model still loading
# and warming up (serve() checks the stop flag after that), then one blocking read (1 s),
# the batch in flight, the read-ahead batch, the replies, leaving the group.
WORKER_DRAIN_BUDGET_S = 30.0
# The metric names worker/metrics.py exports, read from its families (not a copy); alert rules may
# use only these.
METRICS = frozenset(metric_names())
_OWN_ENV = re.compile(r"INFERFLEET_|REDIS_URL\Z")
_WORKER_FIELDS = frozenset(f.name for f in fields(WorkerSettings))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(data: Any) -> Any:
    """A compose file as a user with none of its variables set sees it: ``${VAR:-default}``,
    ``${VAR-default}`` and ``${VAR}`` replaced by their defaults (the last by nothing)."""
    if isinstance(data, dict):
        return {k: interpolate(v) for k, v in data.items()}
    if isinstance(data, list):
        return [interpolate(v) for v in data]
    return _VARIABLE.sub(lambda m: m.group(2) or "", data) if isinstance(data, str) else data


# --------------------------------------------------------------------------- the CLI


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """Exactly ``env`` as inferfleet's variables, whatever the test process has set."""
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if _OWN_ENV.match(k)]:
            del os.environ[key]
        os.environ.update(env)
        yield


def resolve_command(argv: list[str]) -> tuple[click.Command | None, list[str], list[str]]:
    """(leaf command, its words, the arguments left) for ``inferfleet ARGV``."""
    command: click.Command = main
    words: list[str] = []
    rest = list(argv)
    while isinstance(command, click.Group):
        if not rest or rest[0] not in command.commands:
            return None, words + rest[:1], rest[1:]
        words.append(rest[0])
        command = command.commands[rest.pop(0)]
    return command, words, rest


def command_problems(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, Any]]:
    """Problems running ``inferfleet ARGV`` with ``env``; also the parsed parameters."""
    command, words, rest = resolve_command(argv)
    if command is None:
        return [f"inferfleet has no command {' '.join(words)!r}"], {}
    where = f"inferfleet {' '.join(words)}"
    opts = {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
    problems = [
        f"{where} has no option {a.split('=')[0]}"
        for a in rest
        if a.startswith("--") and a.split("=")[0] not in opts
    ]
    envvars = {p.envvar for p in command.params if isinstance(p.envvar, str)}
    problems += [
        f"{k} is not the variable of any option of {where}"
        for k in env
        if _OWN_ENV.match(k) and k not in envvars
    ]
    if problems:
        return problems, {}
    return _parse(command, where, rest, env)


def _parse(
    command: click.Command, where: str, rest: list[str], env: dict[str, str]
) -> tuple[list[str], dict[str, Any]]:
    """Let click parse it (types, choices, required options), then WorkerSettings validate it."""
    try:
        with _environ({k: v for k, v in env.items() if _OWN_ENV.match(k)}):
            params = command.make_context(where, list(rest)).params
    except click.ClickException as exc:
        return [f"{where}: {exc.format_message()}"], {}
    if command.name in ("worker", "supervise"):
        try:
            WorkerSettings(
                **{k: v for k, v in params.items() if k in _WORKER_FIELDS and v is not None}
            )
        except ConfigError as exc:
            return [f"{where}: {exc}"], params
    if command.name == "scaler":  # the policy the scaler would run, validated as it would be
        try:
            policy_settings(params["min_workers"], params["max_workers"], dict(params))
        except ConfigError as exc:
            return [f"{where}: {exc}"], params
    return [], params


def as_argv(value: Any) -> list[str]:
    """A compose command or Kubernetes args: a list, or one string split like a shell."""
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value or []]


def parse_duration_s(text: Any) -> float:
    """A compose duration ("45s", "1m30s", "1500ms") in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ValueError(f"not a compose duration: {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


# --------------------------------------------------------------------------- Dockerfile


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    out = []
    for line in joined.splitlines():
        if line.strip():
            instr, _, args = line.strip().partition(" ")
            out.append((instr.upper(), args.strip()))
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)


def _copy_sources(instrs: list[tuple[str, str]]) -> list[str]:
    sources: list[str] = []
    for instr, args in instrs:
        if instr == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources += words[:-1]
    return sources


def copy_problems(instrs: list[tuple[str, str]], root: Path, dockerignore: list[str]) -> list[str]:
    """Every COPY source exists in the repository and is not excluded from the context."""
    problems = []
    for source in _copy_sources(instrs):
        if not (root / source).exists():
            problems.append(f"COPY {source}: no such file in the repository")
        elif _ignored(os.path.normpath(source), dockerignore):
            problems.append(f"COPY {source}: excluded by .dockerignore")
    return problems


def package_copy_problems(instrs: list[tuple[str, str]], package_dirs: list[str]) -> list[str]:
    """Every folder pyproject.toml maps a package to is copied into the image before the install."""
    copied = {os.path.normpath(s) for s in _copy_sources(instrs)}
    return [
        f"the package folder {d} is not copied into the image"
        for d in package_dirs
        if os.path.normpath(d) not in copied
    ]


def base_image(instrs: list[tuple[str, str]]) -> str | None:
    """The image the Dockerfile starts FROM, its ``${ARG}`` resolved to the ARG's default."""
    args = dict(a.partition("=")[::2] for i, a in instrs if i == "ARG")
    image = next((a for i, a in instrs if i == "FROM"), None)
    return (
        None
        if image is None
        else _VARIABLE.sub(lambda m: args.get(m.group(1), "").strip('"'), image)
    )


def build_steps_problems(instrs: list[tuple[str, str]]) -> list[str]:
    """Base image, the torch index build argument, the project install, the models."""
    args = dict(a.partition("=")[::2] for i, a in instrs if i == "ARG")
    runs = [a for i, a in instrs if i == "RUN"]
    problems = []
    if base_image(instrs) != "python:3.11-slim":
        problems.append(f"the image is not FROM python:3.11-slim (FROM {base_image(instrs)})")
    if "download.pytorch.org/whl/cpu" not in args.get("TORCH_INDEX_URL", ""):
        problems.append("ARG TORCH_INDEX_URL does not default to the PyTorch CPU index")
    if not any("--index-url" in r and "${TORCH_INDEX_URL}" in r for r in runs):
        problems.append("no RUN pip install takes torch from ${TORCH_INDEX_URL}")
    if not any(re.search(r"""pip install .*["']?\.\[worker,\$\{ONNX_EXTRA\}\]""", r) for r in runs):
        problems.append(
            'no RUN pip install ".[worker,${ONNX_EXTRA}]" (the project, its worker side and '
            "ONNX Runtime)"
        )
    if args.get("ONNX_EXTRA") != "onnx":
        problems.append("ARG ONNX_EXTRA does not default to onnx (the CPU build of ONNX Runtime)")
    if not any("tests/fixtures/build_models.py" in s for s in _copy_sources(instrs)):
        problems.append("tests/fixtures/build_models.py is not copied into the image")
    return problems


def pin_problems(instrs: list[tuple[str, str]], tested: dict[str, str]) -> list[str]:
    """torch and redis-py are pinned (ARG TORCH_SPEC, REDIS_SPEC) to ``tested``: the versions the
    tests ran."""
    args = {k: v.strip('"') for k, v in (a.partition("=")[::2] for i, a in instrs if i == "ARG")}
    runs = " ".join(a for i, a in instrs if i == "RUN")
    wanted = {
        "TORCH_SPEC": f"torch=={tested['torch']}",
        "REDIS_SPEC": f"redis[hiredis]=={tested['redis']}",
    }
    problems = [
        f"ARG {arg} is {args.get(arg)!r}, not {spec!r} (the version the tests ran)"
        for arg, spec in wanted.items()
        if args.get(arg) != spec
    ]
    return problems + [
        f"no RUN pip install uses ${{{arg}}}" for arg in wanted if f"${{{arg}}}" not in runs
    ]


def built_models(instrs: list[tuple[str, str]]) -> set[str]:
    """Paths of the model files ``RUN python -m tests.fixtures.build_models`` writes."""
    from tests.fixtures.build_models import DEFAULT_MODELS

    for instr, args in instrs:
        if instr == "RUN" and "tests.fixtures.build_models" in args:
            words = shlex.split(args)
            out = words[words.index("--out") + 1] if "--out" in words else "models"
            only = (
                words[words.index("--only") + 1].split(",") if "--only" in words else DEFAULT_MODELS
            )
            files = (
                {f"{kind}.pt" for kind in only}
                | ({"affine.pt2"} if "affine" in only else set())
                | ({"stack.pt2", "stack.npy"} if "stack" in only else set())
            )
            return {f"{out}/{name}" for name in files}
    return set()


def runtime_problems(instrs: list[tuple[str, str]], scripts: dict[str, str]) -> list[str]:
    """Non-root user, SIGTERM, the metrics port, and the console script as ENTRYPOINT."""
    users = [a for i, a in instrs if i == "USER"]
    entry = [a for i, a in instrs if i == "ENTRYPOINT"]
    problems = []
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the image runs as root (no USER, or USER root)")
    if ("STOPSIGNAL", "SIGTERM") not in instrs:
        problems.append("STOPSIGNAL is not SIGTERM, the signal that drains")
    if not any(str(METRICS_PORT) in a.split() for i, a in instrs if i == "EXPOSE"):
        problems.append(f"the metrics port {METRICS_PORT} is not EXPOSEd")
    if not entry or json.loads(entry[-1]) != [CONSOLE_SCRIPT]:
        problems.append(f'ENTRYPOINT is not ["{CONSOLE_SCRIPT}"]')
    if scripts.get(CONSOLE_SCRIPT) != "inferfleet.__main__:main":
        problems.append(
            f"pyproject.toml has no console script {CONSOLE_SCRIPT} = inferfleet.__main__:main"
        )
    return problems


def model_problems(where: str, params: dict[str, Any], models: set[str]) -> list[str]:
    """The model a service serves is one the image builds (a pipeline stage's split:
    :func:`pipeline_problems`)."""
    model = params.get("model") or params.get("model_path")
    if params.get("stage") is not None:
        return []
    if params.get("example") is not None and params["example"] not in models:  # inferfleet split
        return [
            f"{where}: example {params['example']} is not built into the image "
            f"({', '.join(sorted(models))})"
        ]
    if model is not None and model not in models:
        return [f"{where}: model {model} is not built into the image ({', '.join(sorted(models))})"]
    return []


# --------------------------------------------------------------------------- docker compose


def env_of(service: dict) -> dict[str, str]:
    """A service's environment as a dict of strings (compose allows a list of K=V too)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {
        str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
        for k, v in env.items()
    }


def merge_compose(base: dict, override: dict) -> dict:
    """``docker compose -f base -f override``: mappings merged, environments by key, the rest
    replaced."""
    merged = copy.deepcopy(base)
    for name, service in (override.get("services") or {}).items():
        target = merged.setdefault("services", {}).setdefault(name, {})
        for key, value in service.items():
            if key == "environment":
                target[key] = {**env_of(target), **env_of(service)}
            elif isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = _merge_dicts(target[key], value)
            else:
                target[key] = copy.deepcopy(value)
    return merged


def _merge_dicts(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = (
            _merge_dicts(a[key], value)
            if isinstance(value, dict) and isinstance(a.get(key), dict)
            else value
        )
    return out


def inferfleet_services(compose: dict) -> dict[str, dict]:
    """Services running the project's image (built here, or tagged inferfleet)."""
    return {
        name: s
        for name, s in compose["services"].items()
        if "build" in s or str(s.get("image", "")).startswith("inferfleet")
    }


def compose_command_problems(compose: dict, models: set[str]) -> tuple[list[str], dict[str, dict]]:
    """Each inferfleet service's command and environment; returns the parsed parameters too."""
    problems, parsed = [], {}
    for name, service in inferfleet_services(compose).items():
        if "entrypoint" in service and as_argv(service["entrypoint"]) != [CONSOLE_SCRIPT]:
            problems.append(f"service {name}: entrypoint is not {CONSOLE_SCRIPT}")
        found, params = command_problems(as_argv(service.get("command")), env_of(service))
        problems += [f"service {name}: {p}" for p in found]
        problems += model_problems(f"service {name}", params, models)
        parsed[name] = params
    return problems, parsed


def redis_service_problems(compose: dict) -> list[str]:
    """A redis:7 service with AOF, noeviction, a healthcheck and a named volume at /data."""
    redis = {
        n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("redis:")
    }
    if not redis:
        return ["no redis service"]
    problems = []
    for name, service in redis.items():
        command = " ".join(as_argv(service.get("command")))
        checks = {
            "image redis:7": service["image"] in ("redis:7", "redis:7-alpine"),
            "--appendonly yes": "--appendonly yes" in command,
            "--maxmemory-policy noeviction": "--maxmemory-policy noeviction" in command,
            "a healthcheck": bool((service.get("healthcheck") or {}).get("test")),
            "a named volume at /data": ("/data" in _named_mounts(compose, service)),
        }
        problems += [f"service {name} lacks {what}" for what, ok in checks.items() if not ok]
    return problems


def _named_mounts(compose: dict, service: dict) -> set[str]:
    """Container paths where a named volume (declared at the top level) is mounted."""
    mounts = [str(v).split(":") for v in service.get("volumes") or []]
    return {m[1] for m in mounts if len(m) > 1 and m[0] in (compose.get("volumes") or {})}


def loopback_problems(compose: dict) -> list[str]:
    """Every published port is on 127.0.0.1 unless the operator asks otherwise (a variable)."""
    return [
        f"service {name}: port {port} is not published on 127.0.0.1"
        for name, service in compose["services"].items()
        for port in service.get("ports") or []
        if not str(port).startswith("127.0.0.1:")
    ]


def redis_url_problems(compose: dict) -> list[str]:
    """Every REDIS_URL names the compose Redis service on its port."""
    redis = {
        n for n, s in compose["services"].items() if str(s.get("image", "")).startswith("redis:")
    }
    problems = []
    for name, service in compose["services"].items():
        url = env_of(service).get("REDIS_URL")
        if url is not None:
            parts = urlsplit(url)
            if (
                parts.scheme != "redis"
                or parts.hostname not in redis
                or (parts.port or 6379) != 6379
            ):
                problems.append(
                    f"service {name}: REDIS_URL {url} is not the compose Redis "
                    f"({sorted(redis)}:6379)"
                )
    return problems


def metrics_problems(compose: dict, parsed: dict[str, dict], prometheus: dict) -> list[str]:
    """The supervisor serves metrics on the agreed port, publishes it, and Prometheus scrapes it."""
    targets = {
        t
        for job in prometheus.get("scrape_configs") or []
        for sc in job.get("static_configs") or []
        for t in sc.get("targets") or []
    }
    problems = []
    for name, service in inferfleet_services(compose).items():
        if (
            parsed.get(name) and as_argv(service["command"])[0] == "supervise"
        ):  # else its command is at fault
            port = parsed[name].get("metrics_port")
            published = {str(p).rsplit(":", 1)[-1] for p in service.get("ports") or []}
            if port != METRICS_PORT:
                problems.append(f"service {name}: metrics port {port}, not {METRICS_PORT}")
            if str(port) not in published:
                problems.append(
                    f"service {name}: metrics port {port} is not in its ports {sorted(published)}"
                )
            if f"{name}:{port}" not in targets:
                problems.append(
                    f"Prometheus does not scrape {name}:{port} (targets: {sorted(targets)})"
                )
            check = (service.get("healthcheck") or {}).get("test")
            problems += probe_problems(f"service {name}: healthcheck", check, port)
    return problems


def probe_problems(where: str, command: Any, port: Any) -> list[str]:
    """A health or readiness check reads the worker's /metrics for a served model version
    (inferfleet_model_info is set once the model is loaded and warmed up)."""
    text = " ".join(as_argv(command))
    if f"127.0.0.1:{port}/metrics" not in text or "inferfleet_model_info{" not in text:
        return [f"{where} does not read inferfleet_model_info from 127.0.0.1:{port}/metrics"]
    return []


def grace_problems(compose: dict, parsed: dict[str, dict]) -> list[str]:
    """stop_grace_period outlasts the supervisor's drain timeout (else Docker SIGKILLs the
    drain)."""
    problems = []
    for name, params in parsed.items():
        if "drain_timeout_s" in params:
            grace = parse_duration_s(compose["services"][name].get("stop_grace_period", "10s"))
            if grace <= params["drain_timeout_s"]:
                problems.append(
                    f"service {name}: stop_grace_period {grace:g} s does not exceed "
                    f"the drain timeout {params['drain_timeout_s']:g} s"
                )
    return problems


def gpu_problems(compose: dict, instrs: list[tuple[str, str]]) -> list[str]:
    """Some service reserves NVIDIA GPUs, and its build arguments are ARGs of the Dockerfile."""
    declared = {a.partition("=")[0] for i, a in instrs if i == "ARG"}
    problems, reserving = [], False
    for name, service in compose["services"].items():
        build = service.get("build")
        args = (build.get("args") or {}) if isinstance(build, dict) else {}
        for arg in args:
            if arg not in declared:
                problems.append(f"service {name}: build arg {arg} is not an ARG of the Dockerfile")
        if "TORCH_INDEX_URL" in args and args.get("ONNX_EXTRA") != "gpu":
            problems.append(
                f"service {name}: a CUDA build without ONNX_EXTRA: gpu (its ONNX Runtime "
                "would be the CPU build, which refuses .onnx models on cuda)"
            )
        devices = (
            ((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
        ).get("devices")
        reserving |= any(
            d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
            for d in devices or []
        )
    if not reserving:
        problems.append("no service reserves a device with driver nvidia and capabilities [gpu]")
    return problems


def prometheus_problems(compose: dict, prometheus: dict, rules: dict, root: Path) -> list[str]:
    """Config and rule files reach the container through a mount; alerts use agreed metric names
    only."""
    servers = [
        s
        for s in compose["services"].values()
        if str(s.get("image", "")).startswith("prom/prometheus")
    ]
    mounts = [v.split(":")[:2] for s in servers for v in s.get("volumes") or []]
    configs = [
        a.split("=", 1)[1]
        for s in servers
        for a in as_argv(s.get("command"))
        if a.startswith("--config.file=")
    ]
    problems = [] if configs else ["the Prometheus service names no --config.file"]
    for rule_file in configs + list(prometheus.get("rule_files") or []):
        local = [
            root / src / os.path.relpath(rule_file, dst)
            for src, dst in mounts
            if src.startswith(".") and rule_file.startswith(dst.rstrip("/") + "/")
        ]
        if not any(p.is_file() for p in local):
            problems.append(f"Prometheus file {rule_file} is not mounted from the repository")
    exprs = [r.get("expr", "") for g in rules.get("groups") or [] for r in g.get("rules") or []]
    used = {
        re.sub(r"_(bucket|sum|count)$", "", m)
        for e in exprs
        for m in re.findall(r"inferfleet_\w+", e)
    }
    problems += [
        f"alert rules use {m}, which is not an agreed metric" for m in sorted(used - METRICS)
    ]
    if not any("inferfleet_queue_lag" in e for e in exprs):
        problems.append("no alert on inferfleet_queue_lag")
    if not any(re.search(r'inferfleet_requests_total\{code!="ok"\}', e) for e in exprs):
        problems.append('no alert on the error rate (inferfleet_requests_total{code!="ok"})')
    return problems


# --------------------------------------------------------------------------- Kubernetes


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def _secret_value(docs: list[dict], ref: dict) -> str | None:
    secret = by_kind(docs, "Secret").get(ref.get("name", ""))
    if secret is None:
        return None
    return (secret.get("stringData") or {}).get(ref.get("key", ""))


def container_env(docs: list[dict], container: dict) -> tuple[dict[str, str], list[str]]:
    """A container's environment, secretKeyRefs resolved from the manifests' Secrets."""
    env, problems = {}, []
    for item in container.get("env") or []:
        if "value" in item:
            env[item["name"]] = str(item["value"])
            continue
        ref = (item.get("valueFrom") or {}).get("secretKeyRef") or {}
        value = _secret_value(docs, ref)
        if value is None:
            problems.append(
                f"{item['name']}: no Secret {ref.get('name')!r} with key {ref.get('key')!r}"
            )
        else:
            env[item["name"]] = value
    return env, problems


def _keda_env_names(docs: list[dict], deployment: str) -> set[str]:
    """Environment variables that a ScaledObject targeting ``deployment`` reads (*FromEnv)."""
    return {
        str(v)
        for so in by_kind(docs, "ScaledObject").values()
        if so["spec"]["scaleTargetRef"].get("name") == deployment
        for t in so["spec"].get("triggers") or []
        for k, v in (t.get("metadata") or {}).items()
        if k.endswith("FromEnv")
    }


def is_scaler(deployment: dict) -> bool:
    """A Deployment of ``inferfleet scaler`` (scaler.yaml), not of workers."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return as_argv(container.get("args"))[:1] == ["scaler"]


def worker_deployments(docs: list[dict]) -> dict[str, dict]:
    """The Deployments whose pods run workers (by name)."""
    return {n: d for n, d in by_kind(docs, "Deployment").items() if not is_scaler(d)}


def worker_pod_problems(docs: list[dict], models: set[str]) -> tuple[list[str], dict[str, dict]]:
    """Each worker Deployment: one ``inferfleet worker`` per pod, its options, env, port,
    resources."""
    problems, parsed = [], {}
    for name, dep in worker_deployments(docs).items():
        pod = dep["spec"]["template"]
        container = pod["spec"]["containers"][0]
        where = f"Deployment {name}"
        env, found = container_env(docs, container)
        problems += [f"{where}: {p}" for p in found]
        argv = as_argv(container.get("args"))
        if container.get("command") not in (None, [CONSOLE_SCRIPT]) or argv[:1] != ["worker"]:
            problems.append(
                f"{where}: each pod must run one `{CONSOLE_SCRIPT} worker`, not {argv[:1]}"
            )
        extra = {k for k in env if not _OWN_ENV.match(k)} - _keda_env_names(docs, name)
        problems += [f"{where}: {k} is read by neither inferfleet nor KEDA" for k in sorted(extra)]
        found, params = command_problems(argv, env)
        problems += [f"{where}: {p}" for p in found] + model_problems(where, params, models)
        problems += _port_problems(where, pod, container, params) if params else []
        problems += _resource_problems(where, container)
        parsed[name] = {**params, "_env": env}
    return problems, parsed


def _port_problems(where: str, pod: dict, container: dict, params: dict) -> list[str]:
    port = params.get("metrics_port")
    ports = {
        p.get("containerPort") for p in container.get("ports") or [] if p.get("name") == "metrics"
    }
    annotation = (pod["metadata"].get("annotations") or {}).get("prometheus.io/port")
    problems = []
    if port != METRICS_PORT:
        problems.append(f"{where}: --metrics-port is {port}, not {METRICS_PORT}")
    if ports != {port}:
        problems.append(
            f"{where}: containerPort 'metrics' {sorted(ports)} is not the metrics port {port}"
        )
    if annotation != str(port):
        problems.append(f"{where}: annotation prometheus.io/port {annotation!r} is not {port}")
    probe = (container.get("readinessProbe") or {}).get("exec", {}).get("command")
    return problems + probe_problems(f"{where}: readinessProbe", probe, port)


def _resource_problems(where: str, container: dict) -> list[str]:
    resources = container.get("resources") or {}
    return [
        f"{where}: no resources.{part}.{what}"
        for part in ("requests", "limits")
        for what in ("cpu", "memory")
        if what not in (resources.get(part) or {})
    ]


def liveness_problems(docs: list[dict]) -> list[str]:
    """A worker pod is restarted when hung: a liveness probe reads the heartbeat file the worker
    writes (its INFERFLEET_HEARTBEAT_FILE), and starts only once the model is loaded."""
    problems = []
    for name, dep in worker_deployments(docs).items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        live = " ".join(
            as_argv(((container.get("livenessProbe") or {}).get("exec") or {}).get("command"))
        )
        if not env.get("INFERFLEET_HEARTBEAT_FILE"):
            problems.append(
                f"Deployment {name}: no INFERFLEET_HEARTBEAT_FILE: the worker writes no heartbeat "
                "file"
            )
        if (
            "INFERFLEET_HEARTBEAT_FILE" not in live
            or "loop_ms" not in live
            or "last_seen_ms" not in live
        ):
            problems.append(
                f"Deployment {name}: the livenessProbe does not read the heartbeat file's ages"
            )
        start = ((container.get("startupProbe") or {}).get("exec") or {}).get("command")
        problems += probe_problems(f"Deployment {name}: startupProbe", start, METRICS_PORT)
    return problems


def liveness_command(docs: list[dict]) -> list[str]:
    """The first Deployment's liveness probe command (the tests run it on heartbeat files)."""
    container = next(iter(worker_deployments(docs).values()))["spec"]["template"]["spec"][
        "containers"
    ][0]
    return as_argv(container["livenessProbe"]["exec"]["command"])


def secret_problems(applied: list[dict]) -> list[str]:
    """``kubectl apply -f deploy/k8s/`` creates no Secret: it would overwrite the real one."""
    return [
        f"Secret {d['metadata']['name']} is in the applied manifests: applying them would "
        "overwrite the real one"
        for d in applied
        if d.get("kind") == "Secret"
    ]


def grace_period_problems(docs: list[dict]) -> list[str]:
    """terminationGracePeriodSeconds covers the preStop pause plus the worker's drain."""
    problems = []
    for name, dep in worker_deployments(docs).items():
        spec = dep["spec"]["template"]["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        pre = (
            ((spec["containers"][0].get("lifecycle") or {}).get("preStop") or {})
            .get("exec", {})
            .get("command")
        )
        if not pre or pre[0] != "sleep":
            problems.append(f"Deployment {name}: no preStop `sleep N` hook")
            continue
        if grace < float(pre[1]) + WORKER_DRAIN_BUDGET_S:
            problems.append(
                f"Deployment {name}: terminationGracePeriodSeconds {grace} < preStop {pre[1]} s "
                f"+ a worker's drain ({WORKER_DRAIN_BUDGET_S:g} s)"
            )
    return problems


def selector_problems(docs: list[dict]) -> list[str]:
    """Deployment and PodDisruptionBudget selectors select the worker pods."""
    labels = {
        n: d["spec"]["template"]["metadata"].get("labels") or {}
        for n, d in by_kind(docs, "Deployment").items()
    }
    problems = []
    for name, dep in worker_deployments(docs).items():
        if not _selects(dep["spec"]["selector"], labels[name]):
            problems.append(f"Deployment {name}: its selector does not match its pod labels")
    for name, pdb in by_kind(docs, "PodDisruptionBudget").items():
        if not any(_selects(pdb["spec"]["selector"], pod) for pod in labels.values()):
            problems.append(f"PodDisruptionBudget {name}: its selector matches no worker pod")
    return problems


def _selects(selector: dict, labels: dict) -> bool:
    wanted = selector.get("matchLabels") or {}
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def keda_problems(docs: list[dict], parsed: dict[str, dict]) -> list[str]:
    """Each ScaledObject scales a worker Deployment: on its queue's stream and group lag, or on
    the count a scaler serves (scaler_problems) with the group's pending entries beside it."""
    problems = []
    for name, so in by_kind(docs, "ScaledObject").items():
        spec, where = so["spec"], f"ScaledObject {name}"
        target = spec["scaleTargetRef"]
        if target.get("kind", "Deployment") != "Deployment" or target.get("name") not in parsed:
            problems.append(f"{where}: scaleTargetRef {target.get('name')!r} is no Deployment here")
            continue
        problems += _scaling_problems(where, spec, parsed[target["name"]])
        for trigger in spec.get("triggers") or []:
            if trigger.get("type") != "metrics-api":  # the scaler's: scaler_problems
                problems += _trigger_problems(docs, where, trigger, parsed[target["name"]])
    return problems


def _scaling_problems(where: str, spec: dict, params: dict) -> list[str]:
    low, high = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    problems = []
    if spec.get("pollingInterval") != 5:
        problems.append(
            f"{where}: pollingInterval {spec.get('pollingInterval')}, not the article's 5 s"
        )
    if not 0 <= low <= high:
        problems.append(f"{where}: replicas from {low} to {high}")
    kind = (
        "redis-cluster-streams" if params.get("cluster") else "redis-streams"
    )  # the scaler for the topology
    kinds = [t.get("type") for t in spec.get("triggers") or []]
    if kinds not in ([kind], ["metrics-api", kind]):
        problems.append(
            f"{where}: the triggers are {kinds}, not one {kind} trigger on the lag or a "
            f"metrics-api trigger on a scaler's count with a {kind} trigger on pending entries"
        )
    return problems


def _trigger_problems(docs: list[dict], where: str, trigger: dict, params: dict) -> list[str]:
    meta = trigger.get("metadata") or {}
    problems = [
        f"{where}: metadata {k} must be a string (KEDA metadata is map[string]string)"
        for k, v in meta.items()
        if not isinstance(v, str)
    ]
    try:  # the worker's own stream: its shard's, when the queue is sharded
        shards = shard_keys(
            params.get("name") or "",
            params.get("shards") or 1,
            params.get("prefix") or DEFAULT_PREFIX,
        )
        stream = stage_keys(shards[params.get("shard") or 0], params.get("stage") or 0).requests
    except (ProtocolError, IndexError) as exc:
        return problems + [f"{where}: {exc}"]
    expected = {"stream": stream, "consumerGroup": GROUP, "lagCount": "50"}
    if "pendingEntriesCount" in meta:  # beside a scaler's count: busy workers are kept
        expected = {"stream": stream, "consumerGroup": GROUP}
        problems += _pending_problems(where, meta["pendingEntriesCount"], params)
    problems += [
        f"{where}: {k} is {meta.get(k)!r}, not {v!r}"
        for k, v in expected.items()
        if meta.get(k) != v
    ]
    if "lagCount" in expected and "activationLagCount" not in meta:
        problems.append(f"{where}: no activationLagCount (KEDA needs it with lagCount)")
    return problems + _redis_auth_problems(docs, where, trigger, params["_env"])


def _pending_problems(where: str, count: Any, params: dict) -> list[str]:
    """pendingEntriesCount is at least one batch: the pending entries then keep a pod while any
    is pending, and never ask for more pods than the workers that hold them."""
    rows = params.get("max_batch_rows") or 0
    if not (isinstance(count, str) and count.isdigit() and int(count) >= rows):
        return [f"{where}: pendingEntriesCount {count!r} is under one batch ({rows} rows)"]
    return []


def scaler_problems(docs: list[dict], parsed: dict[str, dict]) -> list[str]:
    """Each scaler Deployment runs ``inferfleet scaler`` for a worker Deployment's queue, a Service
    exposes its port, and that Deployment's ScaledObject reads its count (metrics-api) with the
    scaler's bounds as its replica bounds."""
    problems = []
    for name, dep in by_kind(docs, "Deployment").items():
        if not is_scaler(dep):
            continue
        where, pod = f"Deployment {name}", dep["spec"]["template"]
        container = pod["spec"]["containers"][0]
        env, found = container_env(docs, container)
        found_cmd, params = command_problems(as_argv(container.get("args")), env)
        problems += [f"{where}: {p}" for p in found + found_cmd]
        if not params:
            continue
        problems += _scaler_probe_problems(where, container, params["port"])
        problems += _resource_problems(where, container)
        workers = [w for w, p in parsed.items() if _same_queue(p, params)]
        if not workers:
            problems.append(f"{where}: no worker Deployment serves queue {params['name']!r}")
            continue
        url = _service_url(docs, pod["metadata"].get("labels") or {}, params["port"])
        if url is None:
            problems.append(f"{where}: no Service selects its pod on port {params['port']}")
        for worker in workers:
            problems += _reader_problems(docs, worker, url, params)
    return problems


def _same_queue(worker: dict, scaler: dict) -> bool:
    return (worker.get("name"), worker.get("prefix")) == (scaler.get("name"), scaler.get("prefix"))


def _scaler_probe_problems(where: str, container: dict, port: int) -> list[str]:
    named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    problems = [] if port in named.values() else [f"{where}: no containerPort {port}"]
    for probe in ("readinessProbe", "livenessProbe"):
        get = (container.get(probe) or {}).get("httpGet") or {}
        if get.get("path") != "/healthz" or named.get(get.get("port"), get.get("port")) != port:
            problems.append(f"{where}: {probe} does not GET /healthz on port {port}")
    return problems


def _service_url(docs: list[dict], labels: dict, port: int) -> str | None:
    """The in-cluster URL of /desired through a Service selecting ``labels`` on ``port``."""
    for name, service in by_kind(docs, "Service").items():
        spec = service["spec"]
        if _selects({"matchLabels": spec.get("selector") or {}}, labels):
            for entry in spec.get("ports") or []:
                if entry.get("port") == port:
                    namespace = service["metadata"].get("namespace", "default")
                    return f"http://{name}.{namespace}.svc.cluster.local:{port}/desired"
    return None


def _reader_problems(docs: list[dict], worker: str, url: str | None, params: dict) -> list[str]:
    """The worker Deployment's ScaledObject reads the scaler's count, with its bounds."""
    for name, so in by_kind(docs, "ScaledObject").items():
        spec = so["spec"]
        if spec["scaleTargetRef"].get("name") != worker:
            continue
        where = f"ScaledObject {name}"
        readers = [t for t in spec.get("triggers") or [] if t.get("type") == "metrics-api"]
        if not readers:
            return [f"{where}: no metrics-api trigger reads the scaler of {worker}"]
        meta = readers[0].get("metadata") or {}
        expected = {"valueLocation": "desired", "targetValue": "1"}
        if url is not None:
            expected["url"] = url
        problems = [
            f"{where}: metrics-api {k} is {meta.get(k)!r}, not {v!r}"
            for k, v in expected.items()
            if meta.get(k) != v
        ]
        if not 0 < float(meta.get("activationTargetValue") or 0) < 1:
            problems.append(f"{where}: activationTargetValue must lie in (0, 1): one desired wakes")
        bounds = (spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100))
        if bounds != (params["min_workers"], params["max_workers"]):
            problems.append(
                f"{where}: replicas {bounds} are not the scaler's --min-workers/--max-workers "
                f"{(params['min_workers'], params['max_workers'])}"
            )
        return problems
    return [f"Deployment {worker}: no ScaledObject scales it on its scaler's count"]


def _redis_auth_problems(
    docs: list[dict], where: str, trigger: dict, env: dict[str, str]
) -> list[str]:
    """KEDA reaches the Redis the workers use: address from their env, password from the Secret."""
    meta, url = trigger.get("metadata") or {}, urlsplit(env.get("REDIS_URL", ""))
    node = f"{url.hostname}:{url.port or 6379}"
    problems = []
    if (
        trigger.get("type") == "redis-cluster-streams"
    ):  # a list of nodes; REDIS_URL names one of them
        addresses = env.get(str(meta.get("addressesFromEnv")), meta.get("addresses")) or ""
        if node not in addresses.split(","):
            problems.append(
                f"{where}: KEDA's addresses {addresses!r} do not hold REDIS_URL's {node}"
            )
    elif env.get(str(meta.get("addressFromEnv")), meta.get("address")) != node:
        address = env.get(str(meta.get("addressFromEnv")), meta.get("address"))
        problems.append(f"{where}: KEDA's address {address!r} is not REDIS_URL's {node}")
    auth = by_kind(docs, "TriggerAuthentication").get(
        (trigger.get("authenticationRef") or {}).get("name", "")
    )
    refs = {
        r.get("parameter"): r for r in (auth or {}).get("spec", {}).get("secretTargetRef") or []
    }
    if "password" not in refs:
        problems.append(f"{where}: no TriggerAuthentication with a password parameter")
    elif _secret_value(docs, refs["password"]) != (url.password or None):
        problems.append(f"{where}: the TriggerAuthentication's password is not REDIS_URL's")
    return problems


def gpu_pod_problems(docs: list[dict]) -> list[str]:
    """The GPU variant asks the device plugin for a GPU and runs on CUDA."""
    problems = []
    for name, dep in worker_deployments(docs).items():
        container = dep["spec"]["template"]["spec"]["containers"][0]
        gpus = ((container.get("resources") or {}).get("limits") or {}).get("nvidia.com/gpu")
        if not isinstance(gpus, int) or gpus < 1:
            problems.append(f"Deployment {name}: no resources.limits nvidia.com/gpu")
        env, _ = container_env(docs, container)
        if not env.get("INFERFLEET_DEVICE", "auto").startswith(("cuda", "auto")):
            problems.append(
                f"Deployment {name}: INFERFLEET_DEVICE {env['INFERFLEET_DEVICE']} is not a GPU"
            )
    return problems


def shard_problems(parsed: dict[str, dict]) -> list[str]:
    """The Deployments of a sharded queue serve each of its shards, each once, all agreeing on S."""
    by_queue: dict[str, list[tuple[str, int, int]]] = {}
    for name, params in parsed.items():
        if (params.get("shards") or 1) > 1:
            by_queue.setdefault(params.get("name") or "", []).append(
                (name, params["shards"], params.get("shard") or 0)
            )
    problems = []
    for queue, deps in by_queue.items():
        counts = {s for _, s, _ in deps}
        if len(counts) != 1:
            problems.append(f"queue {queue}: Deployments disagree on --shards: {sorted(counts)}")
            continue
        served = sorted(shard for _, _, shard in deps)
        if served != list(range(counts.pop())):
            problems.append(
                f"queue {queue}: Deployments serve shards {served}, not each shard once"
            )
        problems += [
            f"Deployment {name}: a sharded queue needs --cluster"
            for name, _, _ in deps
            if not parsed[name].get("cluster")
        ]
    return problems


# --------------------------------------------------------------------------- pipelines


def split_job_problems(docs: list[dict], models: set[str]) -> tuple[list[str], dict[str, dict]]:
    """Each Job runs ``inferfleet split`` on a model and example the image builds; returns their
    parameters."""
    problems, parsed = [], {}
    for name, job in by_kind(docs, "Job").items():
        container = job["spec"]["template"]["spec"]["containers"][0]
        where = f"Job {name}"
        env, found = container_env(docs, container)
        found_cmd, params = command_problems(as_argv(container.get("args")), env)
        problems += [f"{where}: {p}" for p in found + found_cmd] + model_problems(
            where, params, models
        )
        parsed[name] = params
    return problems, parsed


def pipeline_problems(splits: dict[str, dict], workers: dict[str, dict]) -> list[str]:
    """The stage workers of each pipelined queue serve a split some ``inferfleet split`` writes,
    every stage of it at least once and no stage it lacks."""
    outs = {p["out"]: p for p in splits.values() if p.get("out")}
    by_queue: dict[tuple[str, str], set[int]] = {}
    problems = []
    for name, params in workers.items():
        if params.get("stage") is None:
            continue
        split = outs.get(params.get("model") or "")
        if split is None:
            problems.append(
                f"{name}: stage {params['stage']} serves {params.get('model')}, which no "
                f"`inferfleet split --out` writes ({sorted(outs)})"
            )
            continue
        by_queue.setdefault((params.get("name") or "", split["out"]), set()).add(params["stage"])
    for (queue, out), stages in sorted(by_queue.items()):
        want = set(range(len(outs[out]["split_at"]) + 1))
        if stages != want:
            problems.append(
                f"queue {queue}: stages {sorted(stages)} are served, the split {out} has "
                f"{sorted(want)}"
            )
    return problems
