"""Static checks of deploy/k8s: no cluster needed.

* Every object is validated offline against the Kubernetes JSON schemas shipped in the
  ``kubernetes-validate`` PyPI package (strict: unknown fields are errors), and every
  KEDA ScaledObject against the CRD's openAPIV3Schema vendored as
  tests/data/keda-scaledobject-v2.20.2.json (kedacore/keda v2.20.2; made strict here the
  same way: an object that lists its properties accepts no others).
* Container commands parse as real ``llmpipe`` commands with their flags (click parses
  them without running anything); LLMPIPE_* names are real settings.
* KEDA's queue triggers name exactly the Celery queues (celeryconfig) that their target's
  worker kind consumes; trigger metadata keys are ones KEDA's scalers read; the env
  variables the triggers and ``$(VAR)`` references use are defined; the Secret keys used
  exist in secret.example.yaml.
* The promises of issue 12: Redis with AOF, API readiness on /healthz, one Deployment per
  worker kind, the inference one with ``nvidia.com/gpu: 1``, Flower behind auth.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KEDA_SCHEMA = Path(__file__).resolve().parent / "data" / "keda-scaledobject-v2.20.2.json"
K8S_VERSION = "1.30"  # the oldest Kubernetes these manifests claim to support
# Metadata keys read by KEDA v2.20.2's scalers (pkg/scalers/redis_scaler.go and
# cpu_memory_scaler.go, their `keda:"name=..."` tags; a key may carry the FromEnv suffix
# where the tag lists resolvedEnv).
KEDA_KEYS = {
    "redis": {"address", "addresses", "addressFromEnv", "host", "hosts", "hostFromEnv", "port", "ports", "portFromEnv",
              "username", "usernameFromEnv", "password", "passwordFromEnv", "listName", "listLength",
              "activationListLength", "databaseIndex", "enableTLS", "unsafeSsl"},
    "cpu": {"value", "containerName"},
}
WORKER_KINDS = {"llmpipe-preprocess": "preprocess", "llmpipe-postprocess": "postprocess",
                "llmpipe-inference": "inference", "llmpipe-inference-tiny": "inference"}
# Two models behind one API: one inference Deployment (and ScaledObject) per model.
INFERENCE_MODELS = {"llmpipe-inference": "smollm2", "llmpipe-inference-tiny": "tiny"}


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
OBJECTS = [(p.name, d) for p in MANIFESTS for d in _load(p)]


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in OBJECTS if d["kind"] == kind}


def _strict(schema):
    """additionalProperties: false wherever an object lists its properties and does not
    say it keeps unknown fields (what the API server's strict field validation does)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def _containers(obj: dict) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_every_file_is_listed_and_holds_objects():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert listed == {p.name for p in MANIFESTS} - {"secret.example.yaml"}
    assert {i["name"] for i in kust["images"]} == {c["image"] for _, d in OBJECTS if "template" in d.get("spec", {})
                                                   for c in _containers(d) if c["image"].startswith("llmpipe")}
    assert all(d.get("apiVersion") and d.get("kind") for _, d in OBJECTS)


@pytest.mark.parametrize("name,obj", [(f"{n}:{d['kind']}/{d['metadata']['name']}", d) for n, d in OBJECTS
                                      if not d["apiVersion"].startswith("keda.sh/")], ids=lambda x: x if isinstance(x, str) else "")
def test_kubernetes_objects_match_the_schemas(name, obj):
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_keda_scaled_objects_match_the_crd_schema():
    schema = _strict(json.loads(KEDA_SCHEMA.read_text()))
    scaled = _by_kind("ScaledObject")
    assert set(scaled) == {"llmpipe-preprocess", "llmpipe-postprocess", *INFERENCE_MODELS}
    for obj in scaled.values():
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        jsonschema.validate(obj, schema)
    # The check is not vacuous: a misspelt field fails it.
    bad = copy.deepcopy(scaled["llmpipe-inference"])
    bad["spec"]["maxReplicas"] = 4
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_container_commands_are_real_llmpipe_commands():
    from llmpipe.cli import main

    seen = set()
    for _, obj in OBJECTS:
        if "template" not in obj.get("spec", {}):
            continue
        for c in _containers(obj):
            if not c["image"].startswith("llmpipe"):
                continue
            if "command" in c:  # a module of the package, run as a sidecar
                assert c["command"][:3] == ["python", "-m", "llmpipe.observability.exporter"], c["command"]
                from llmpipe.observability.exporter import parser

                parser().parse_args(c["command"][3:])
                seen.add("metrics-exporter")
                continue
            args = c["args"]
            assert args[0] in main.commands, f"{obj['metadata']['name']}: no `llmpipe {args[0]}`"
            cmd = main.commands[args[0]]
            cmd.make_context(args[0], list(args[1:]))  # raises on an unknown flag or a bad choice
            seen.add(" ".join(args[:2]))
    assert {"worker preprocess", "worker postprocess", "worker inference", "model smollm2"} <= seen
    assert {"api --host", "flower --port", "metrics-exporter"} <= seen


def test_llmpipe_variables_are_real_settings():
    from llmpipe.settings import Settings

    names = set()
    for _, d in OBJECTS:
        if d["kind"] == "ConfigMap":
            names |= set(d["data"])
        if "template" in d.get("spec", {}):
            names |= {e["name"] for c in _containers(d) for e in c.get("env", [])}
    unknown = [n for n in names if n.startswith("LLMPIPE_") and n[8:].lower() not in Settings.model_fields]
    assert not unknown


def _env_of(container: dict) -> list[str]:
    """Variable names in definition order: envFrom ConfigMaps first, then env."""
    cms = _by_kind("ConfigMap")
    names = [k for ref in container.get("envFrom", []) for k in cms[ref["configMapRef"]["name"]]["data"]]
    return names + [e["name"] for e in container.get("env", [])]


def test_variable_and_secret_references_resolve():
    secret_keys = set(_load(K8S / "secret.example.yaml")[0]["stringData"])
    for _, d in OBJECTS:
        if "template" not in d.get("spec", {}):
            continue
        for c in _containers(d):
            defined: list[str] = [k for k in _env_of(c) if k not in {e["name"] for e in c.get("env", [])}]
            for e in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                    assert ref in defined, f"{d['metadata']['name']}/{c['name']}: $({ref}) before it is defined"
                key = e.get("valueFrom", {}).get("secretKeyRef")
                if key:
                    assert key["name"] == "llmpipe-secrets" and key["key"] in secret_keys
                defined.append(e["name"])
            for arg in c.get("args", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined


def _served():
    from llmpipe.settings import Settings

    return Settings(models=_by_kind("ConfigMap")["llmpipe-config"]["data"]["LLMPIPE_MODELS"])


def test_keda_triggers_watch_exactly_the_queues_their_workers_consume():
    from workers.launch import queues_of

    settings = _served()
    served = settings.served
    queues = {*served.stage_queues(), "collect"}
    deployments = _by_kind("Deployment")
    for name, so in _by_kind("ScaledObject").items():
        target = so["spec"]["scaleTargetRef"]["name"]
        assert target in deployments
        worker = deployments[target]["spec"]["template"]["spec"]["containers"][0]
        env = set(_env_of(worker))
        lists = set()
        for t in so["spec"]["triggers"]:
            assert set(t["metadata"]) <= KEDA_KEYS[t["type"]], t
            for key, value in t["metadata"].items():
                if key.endswith("FromEnv"):
                    assert value in env, f"{name}: {value} is not in {target}'s environment"
            if t["type"] == "redis":
                lists.add(t["metadata"]["listName"])
                assert int(t["metadata"]["listLength"]) > 0
            if t["type"] == "cpu":
                assert worker["resources"]["requests"]["cpu"], "a CPU trigger needs a CPU request"
        assert lists <= queues
        args = worker["args"]
        model = args[args.index("--model") + 1] if "--model" in args else None
        assert lists == set(queues_of(WORKER_KINDS[target], settings, model)), (name, lists)


def test_one_inference_deployment_and_scaled_object_per_served_model():
    settings = _served()
    assert settings.served.names == ["smollm2", "tiny"]
    deployments = _by_kind("Deployment")
    for name, model in INFERENCE_MODELS.items():
        pod = deployments[name]["spec"]["template"]["spec"]
        worker = pod["containers"][0]
        assert worker["args"] == ["worker", "inference", "--model", model]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert model in pod["initContainers"][0]["args"]  # its model is prepared before it starts
    # The CPU stages and the API hold every model's tokenizer.
    for name in ("llmpipe-preprocess", "llmpipe-postprocess", "llmpipe-api"):
        init = deployments[name]["spec"]["template"]["spec"]["initContainers"][0]["args"]
        assert init[0] == "model" and set(settings.served.names) <= set(init[1:]), name


def test_the_issue_promises():
    deployments = _by_kind("Deployment")
    assert set(WORKER_KINDS) <= set(deployments)
    redis = _by_kind("StatefulSet")["redis"]["spec"]["template"]["spec"]["containers"][0]
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "noeviction" in args and "--requirepass" in args
    api = deployments["llmpipe-api"]["spec"]["template"]["spec"]["containers"][0]
    assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "httpGet" not in api["livenessProbe"]  # a Redis outage must not restart the API
    gpu = deployments["llmpipe-inference"]["spec"]["template"]["spec"]["containers"][0]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    for kind in ("llmpipe-preprocess", "llmpipe-postprocess"):
        limits = deployments[kind]["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        assert "nvidia.com/gpu" not in limits
    flower = deployments["llmpipe-flower"]["spec"]["template"]["spec"]["containers"][0]
    pw = next(e for e in flower["env"] if e["name"] == "LLMPIPE_FLOWER_PASSWORD")
    assert pw["valueFrom"]["secretKeyRef"]["key"] == "flower-password"
    assert _by_kind("Service")["llmpipe-flower"]["spec"].get("type", "ClusterIP") == "ClusterIP"
    for obj in deployments.values():
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
