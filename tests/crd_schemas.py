"""JSON Schemas of the custom resources under deploy/, for the fields they use, written from
the published CRDs (no cluster, and so no API server, validates them here):

- KEDA ``ScaledObject``, ``keda.sh/v1alpha1``: kedacore/keda
  ``config/crd/bases/keda.sh_scaledobjects.yaml`` at 756b2de75bd06e913ea34a9fdf7bcf3100a460ba;
- Prometheus operator ``ServiceMonitor``, ``monitoring.coreos.com/v1``: prometheus-operator
  ``example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml`` (operator
  0.84.1) at 01b1a0ea3113af46d69ae3d2ee717bd10b2de1d1;
- Prometheus operator ``PrometheusRule``, ``monitoring.coreos.com/v1``: prometheus-operator
  ``example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml`` (operator
  0.84.1), the group and rule fields;
- KServe ``InferenceService``, ``serving.kserve.io/v1beta1``: the predictor fields of kserve/kserve
  ``python/kserve/kserve/models/v1beta1_predictor_spec.py`` (generated from the CRD's OpenAPI)
  at 0217bdabaaa250485b336805da1aed04960dc758;
- KEDA HTTP add-on ``HTTPScaledObject``, ``http.keda.sh/v1alpha1``: kedacore/http-add-on
  ``config/crd/bases/http.keda.sh_httpscaledobjects.yaml`` at
  4f5b51de4ba5038771e5e2102a4b6a47fa32795f (with its rule that a target names exactly one of
  ``port`` and ``portName``).

Where a CRD lists more fields than the manifests use, the schema lists only the used ones and
refuses others (``additionalProperties: false``), so a misspelt field fails here instead of
being silently ignored by the controller.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_INT32: Schema = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_STRING: Schema = {"type": "string"}
_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA: Schema = {
    "type": "object",
    "properties": {"name": _STRING, "namespace": _STRING, "labels": _STRING_MAP,
                   "annotations": _STRING_MAP},
    "required": ["name"],
}  # fmt: skip
_DURATION = (
    "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)


def _object(properties: Schema, required: list[str] | None = None) -> Schema:
    return {"type": "object", "properties": properties, "required": required or [],
            "additionalProperties": False}  # fmt: skip


_HPA_POLICY = _object(
    {"type": {"enum": ["Pods", "Percent"]}, "value": _INT32, "periodSeconds": _INT32},
    ["type", "value", "periodSeconds"],
)
_HPA_RULES = _object(
    {
        "stabilizationWindowSeconds": _INT32,
        "selectPolicy": _STRING,
        "policies": {"type": "array", "items": _HPA_POLICY},
    }
)

SCALED_OBJECT: Schema = _object(
    {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "scaleTargetRef": _object(
                    {
                        "apiVersion": _STRING,
                        "kind": _STRING,
                        "name": _STRING,
                        "envSourceContainerName": _STRING,
                    },
                    ["name"],
                ),
                "minReplicaCount": _INT32,
                "maxReplicaCount": _INT32,
                "idleReplicaCount": _INT32,
                "pollingInterval": _INT32,
                "cooldownPeriod": _INT32,
                "fallback": _object(
                    {"failureThreshold": _INT32, "replicas": _INT32},
                    ["failureThreshold", "replicas"],
                ),
                "advanced": _object(
                    {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": _object(
                            {
                                "behavior": _object(
                                    {"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES}
                                ),
                            }
                        ),
                    }
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": _object(
                        {
                            "type": _STRING,
                            "name": _STRING,
                            "metricType": {"enum": ["Value", "AverageValue", "Utilization"]},
                            "metadata": _STRING_MAP,
                        },
                        ["type", "metadata"],
                    ),
                },
            },
            ["scaleTargetRef", "triggers"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

SERVICE_MONITOR: Schema = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "selector": _object({"matchLabels": _STRING_MAP}),
                "namespaceSelector": _object(
                    {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STRING}}
                ),
                "jobLabel": _STRING,
                "endpoints": {
                    "type": "array",
                    "items": _object(
                        {
                            "port": _STRING,
                            "path": _STRING,
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "honorLabels": {"type": "boolean"},
                        }
                    ),
                },
            },
            ["selector"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

_RULE: Schema = {
    "type": "object",
    "properties": {
        "record": _STRING, "alert": _STRING, "expr": {"type": ["string", "integer"]},
        "for": {"type": "string", "pattern": _DURATION},
        "keep_firing_for": {"type": "string", "pattern": _DURATION},
        "labels": _STRING_MAP, "annotations": _STRING_MAP,
    },
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "additionalProperties": False,
}  # fmt: skip

PROMETHEUS_RULE: Schema = _object(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "groups": {
                    "type": "array",
                    "items": _object(
                        {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "rules": {"type": "array", "items": _RULE},
                        },
                        ["name"],
                    ),
                },
            },
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

_CONTAINER: Schema = {
    "type": "object",
    "properties": {
        "name": _STRING, "image": _STRING, "args": {"type": "array"},
        "command": {"type": "array"}, "env": {"type": "array"}, "envFrom": {"type": "array"},
        "ports": {"type": "array"}, "resources": {"type": "object"},
        "readinessProbe": {"type": "object"}, "livenessProbe": {"type": "object"},
        "startupProbe": {"type": "object"}, "securityContext": {"type": "object"},
        "volumeMounts": {"type": "array"},
    },
    "required": ["image"],
    "additionalProperties": False,
}  # fmt: skip

INFERENCE_SERVICE: Schema = _object(
    {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "predictor": _object(
                    {
                        "minReplicas": _INT32,
                        "maxReplicas": _INT32,
                        "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
                        "scaleTarget": _INT32,
                        "containerConcurrency": {"type": "integer"},
                        "timeout": {"type": "integer"},
                        "terminationGracePeriodSeconds": {"type": "integer"},
                        "serviceAccountName": _STRING,
                        "containers": {"type": "array", "minItems": 1, "items": _CONTAINER},
                        "volumes": {"type": "array"},
                    }
                ),
            },
            ["predictor"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

_TARGET: Schema = {
    **_object(
        {"apiVersion": _STRING, "kind": _STRING, "name": _STRING, "port": _INT32,
         "portName": _STRING, "service": _STRING},
        ["service"],
    ),
    "oneOf": [{"required": ["port"]}, {"required": ["portName"]}],
}  # fmt: skip

HTTP_SCALED_OBJECT: Schema = _object(
    {
        "apiVersion": {"const": "http.keda.sh/v1alpha1"},
        "kind": {"const": "HTTPScaledObject"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "hosts": {"type": "array", "items": _STRING},
                "pathPrefixes": {"type": "array", "items": _STRING},
                "headers": {
                    "type": "array",
                    "items": _object(
                        {"name": {"type": "string", "minLength": 1}, "value": _STRING}, ["name"]
                    ),
                },
                "scaleTargetRef": _TARGET,
                "replicas": _object({"min": _INT32, "max": _INT32}),
                "scaledownPeriod": _INT32,
                "initialCooldownPeriod": _INT32,
                "targetPendingRequests": _INT32,
                "scalingMetric": _object(
                    {
                        "concurrency": _object({"targetValue": {"type": "integer"}}),
                        "requestRate": _object(
                            {
                                "granularity": _STRING,
                                "targetValue": {"type": "integer"},
                                "window": _STRING,
                            }
                        ),
                    }
                ),
                "timeouts": _object({"conditionWait": _STRING, "responseHeader": _STRING}),
            },
            ["scaleTargetRef"],
        ),
    },
    ["apiVersion", "kind", "metadata", "spec"],
)

BY_KIND = {
    "HTTPScaledObject": HTTP_SCALED_OBJECT,
    "ScaledObject": SCALED_OBJECT,
    "ServiceMonitor": SERVICE_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
    "InferenceService": INFERENCE_SERVICE,
}
