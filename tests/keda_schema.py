"""A strict JSON Schema of KEDA's ScaledObject and TriggerAuthentication (keda.sh/v1alpha1), for
tests/unit/test_deploy.py.

KEDA's CRDs are not installable here (they are downloads), so this page describes, field for
field, the part of their ``openAPIV3Schema`` that KEDA 2.11 to 2.19 share: the names and types
of every field a ScaledObject or TriggerAuthentication may have at the levels our manifests use,
unknown fields refused. The HPA ``behavior`` inside ``advanced`` is Kubernetes' own type: the
test validates it with kubernetes-validate's HorizontalPodAutoscaler schema instead.
docs/deploy.md says how the manifests were checked against the CRDs of those releases.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEMAS"]

_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_METADATA = {"type": "object"}  # Kubernetes' ObjectMeta: checked by the API server, not here


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_TRIGGER = _object(
    ["type", "metadata"],
    type=_STR,
    name=_STR,
    useCachedMetrics=_BOOL,
    metricType={"enum": ["AverageValue", "Value", "Utilization"]},
    # KEDA's metadata is map[string]string: a number must be quoted
    metadata={"type": "object", "additionalProperties": _STR},
    authenticationRef=_object(["name"], name=_STR, kind=_STR),
)

_ADVANCED = _object(
    [],
    restoreToOriginalReplicaCount=_BOOL,
    horizontalPodAutoscalerConfig=_object([], name=_STR, behavior={"type": "object"}),
)

_SCALED_OBJECT_SPEC = _object(
    ["scaleTargetRef", "triggers"],
    scaleTargetRef=_object(
        ["name"], apiVersion=_STR, kind=_STR, name=_STR, envSourceContainerName=_STR
    ),
    pollingInterval=_INT,
    cooldownPeriod=_INT,
    idleReplicaCount=_INT,
    minReplicaCount=_INT,
    maxReplicaCount=_INT,
    fallback=_object(["failureThreshold", "replicas"], failureThreshold=_INT, replicas=_INT),
    advanced=_ADVANCED,
    triggers={"type": "array", "items": _TRIGGER, "minItems": 1},
)

_SECRET_REF = _object(["parameter", "name", "key"], parameter=_STR, name=_STR, key=_STR)
_ENV_REF = _object(["parameter", "name"], parameter=_STR, name=_STR, containerName=_STR)

_TRIGGER_AUTHENTICATION_SPEC = _object(
    [],
    secretTargetRef={"type": "array", "items": _SECRET_REF},
    env={"type": "array", "items": _ENV_REF},
)


def _document(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _object(
        ["apiVersion", "kind", "metadata", "spec"],
        apiVersion={"const": "keda.sh/v1alpha1"},
        kind={"const": kind},
        metadata=_METADATA,
        spec=spec,
    )


#: ``SCHEMAS[kind]``: the JSON Schema a document of that kind must meet.
SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": _document("ScaledObject", _SCALED_OBJECT_SPEC),
    "TriggerAuthentication": _document("TriggerAuthentication", _TRIGGER_AUTHENTICATION_SPEC),
}
