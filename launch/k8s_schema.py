"""A structural schema of the Kubernetes objects `simloop gke render` emits, and its checker.

    errors = validate(manifest)   # [] or ["spec.replicatedJobs[0]...: unknown field 'parallelizm'"]
    check(manifest)               # raises ManifestError listing every error

Covers the core/v1 shapes we write (Service, ConfigMap, PodSpec, Container, Volume, EnvVar,
ResourceRequirements, ...), batch/v1 JobSpec as embedded in a JobSet, and the JobSet CRD
(jobset.x-k8s.io/v1alpha2): field names and types follow the upstream Go types
(k8s.io/api core/v1 + batch/v1, sigs.k8s.io/jobset api/jobset/v1alpha2). Only the fields a
renderer here could plausibly write are listed, so an unknown field is an error (a typo the
API server would prune or reject), as are a missing required field and a wrong type. A few
cross-field rules are checked as well (volume mounts name a volume, extended resources request
what they limit, one source per volume, a hostNetwork pod resolves cluster DNS). Imports no
JAX.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class ManifestError(ValueError):
    """A rendered manifest that the API server would reject or silently change."""


# --- the type language --------------------------------------------------------------------


@dataclass(frozen=True)
class Scalar:
    kind: str
    """`string`, `integer`, `boolean`, `quantity` (int or string), `int-or-string`."""
    enum: tuple[str, ...] = ()
    pattern: str | None = None
    what: str = ""
    """What `pattern` means, for the error message."""
    minimum: int | None = None
    maximum: int | None = None
    max_len: int | None = None


@dataclass(frozen=True)
class ListOf:
    item: Any
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True)
class MapOf:
    value: Any
    key: Scalar | None = None


@dataclass(frozen=True)
class Obj:
    fields: dict[str, Any]
    required: tuple[str, ...] = ()
    exactly_one: tuple[str, ...] = ()
    """Exactly one of these fields is set (a volume's source)."""
    at_least_one: tuple[str, ...] = ()
    at_most_one: tuple[str, ...] = ()
    consts: dict[str, str] = field(default_factory=dict)
    """Fields that must hold exactly this value (`apiVersion`, `kind`)."""


@dataclass(frozen=True)
class Ref:
    """A named type of `TYPES` (so types can be shared and looked up by name)."""

    name: str


STR = Scalar("string")
BOOL = Scalar("boolean")
INT = Scalar("integer")
NON_NEG = Scalar("integer", minimum=0)
PORT = Scalar("integer", minimum=1, maximum=65535)
QUANTITY = Scalar(
    "quantity",
    pattern=r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[mkMGTPE])?$",
    what="a Kubernetes quantity such as 4, 500m or 16Gi",
)
INT_OR_STR = Scalar("int-or-string")


def enum(*values: str) -> Scalar:
    return Scalar("string", enum=values)


DNS_LABEL = Scalar(
    "string",
    pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    what="a DNS-1123 label (lower-case letters, digits, '-')",
    max_len=63,
)
DNS_1035 = Scalar(
    "string",
    pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
    what="a DNS-1035 label (starts with a letter; lower-case letters, digits, '-')",
    max_len=63,
)
DNS_SUBDOMAIN = Scalar(
    "string",
    pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
    what="a DNS-1123 subdomain",
    max_len=253,
)
QUALIFIED_NAME = Scalar(
    "string",
    pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
    what="a qualified name ([prefix/]name), as label, annotation and resource keys are",
)
LABEL_VALUE = Scalar(
    "string",
    pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$",
    what="a label value (letters, digits, '-', '_', '.'; alphanumeric at both ends)",
    max_len=63,
)
PORT_NAME = Scalar(
    "string",
    pattern=r"^(?=.*[a-z])(?!.*--)[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
    what="an IANA service name (lower-case letters, digits, '-', at least one letter)",
    max_len=15,
)
ENV_NAME = Scalar(
    "string", pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", what="an environment variable name"
)
ABS_PATH = Scalar("string", pattern=r"^/", what="an absolute path")
CONFIG_KEY = Scalar(
    "string", pattern=r"^[-._a-zA-Z0-9]+$", what="a ConfigMap key (letters, digits, '-', '_', '.')"
)
INDEXES = Scalar(
    "string",
    pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$",
    what="job completion indexes such as 0-3,5",
)
PROTOCOL = enum("TCP", "UDP", "SCTP")


# --- the types -----------------------------------------------------------------------------

_META_FIELDS = {
    "name": DNS_SUBDOMAIN,
    "generateName": STR,
    "namespace": DNS_LABEL,
    "labels": MapOf(LABEL_VALUE, key=QUALIFIED_NAME),
    "annotations": MapOf(STR, key=QUALIFIED_NAME),
}

TYPES: dict[str, Obj] = {
    # meta/v1
    "ObjectMeta": Obj(_META_FIELDS),
    "NamedObjectMeta": Obj(_META_FIELDS, required=("name",)),
    # core/v1: Service, ConfigMap
    "Service": Obj(
        {
            "apiVersion": STR,
            "kind": STR,
            "metadata": Ref("ServiceMeta"),
            "spec": Ref("ServiceSpec"),
        },
        required=("apiVersion", "kind", "metadata", "spec"),
        consts={"apiVersion": "v1", "kind": "Service"},
    ),
    "ServiceMeta": Obj({**_META_FIELDS, "name": DNS_1035}, required=("name",)),
    "ServiceSpec": Obj(
        {
            "type": enum("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"),
            "clusterIP": STR,
            "clusterIPs": ListOf(STR),
            "selector": MapOf(LABEL_VALUE, key=QUALIFIED_NAME),
            "ports": ListOf(Ref("ServicePort")),
            "publishNotReadyAddresses": BOOL,
            "sessionAffinity": enum("None", "ClientIP"),
        }
    ),
    "ServicePort": Obj(
        {
            "name": DNS_LABEL,
            "protocol": PROTOCOL,
            "appProtocol": STR,
            "port": PORT,
            "targetPort": INT_OR_STR,
            "nodePort": PORT,
        },
        required=("port",),
    ),
    "ConfigMap": Obj(
        {
            "apiVersion": STR,
            "kind": STR,
            "metadata": Ref("NamedObjectMeta"),
            "data": MapOf(STR, key=CONFIG_KEY),
            "binaryData": MapOf(STR, key=CONFIG_KEY),
            "immutable": BOOL,
        },
        required=("apiVersion", "kind", "metadata"),
        consts={"apiVersion": "v1", "kind": "ConfigMap"},
    ),
    # jobset.x-k8s.io/v1alpha2
    "JobSet": Obj(
        {
            "apiVersion": STR,
            "kind": STR,
            "metadata": Ref("NamedObjectMeta"),
            "spec": Ref("JobSetSpec"),
        },
        required=("apiVersion", "kind", "metadata", "spec"),
        consts={"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet"},
    ),
    "JobSetSpec": Obj(
        {
            "replicatedJobs": ListOf(Ref("ReplicatedJob"), min_items=1),
            "network": Ref("Network"),
            "successPolicy": Ref("JobSetSuccessPolicy"),
            "failurePolicy": Ref("FailurePolicy"),
            "startupPolicy": Ref("StartupPolicy"),
            "suspend": BOOL,
            "coordinator": Ref("Coordinator"),
            "managedBy": STR,
            "ttlSecondsAfterFinished": NON_NEG,
        },
        required=("replicatedJobs",),
    ),
    "ReplicatedJob": Obj(
        {
            "name": DNS_LABEL,
            "groupName": DNS_LABEL,
            "template": Ref("JobTemplateSpec"),
            "replicas": NON_NEG,
            "dependsOn": ListOf(Ref("DependsOn"), max_items=5),
        },
        required=("name", "template"),
    ),
    "DependsOn": Obj(
        {"name": STR, "status": enum("Ready", "Complete")}, required=("name", "status")
    ),
    "Network": Obj(
        {"enableDNSHostnames": BOOL, "subdomain": DNS_1035, "publishNotReadyAddresses": BOOL}
    ),
    "JobSetSuccessPolicy": Obj(
        {"operator": enum("All", "Any"), "targetReplicatedJobs": ListOf(STR)},
        required=("operator",),
    ),
    "FailurePolicy": Obj(
        {
            "maxRestarts": NON_NEG,
            "restartStrategy": enum("Recreate", "BlockingRecreate", "InPlaceRestart"),
            "rules": ListOf(Ref("FailurePolicyRule")),
        }
    ),
    "FailurePolicyRule": Obj(
        {
            "name": STR,
            "action": enum(
                "FailJobSet",
                "RestartJobSet",
                "RestartJobSetAndIgnoreMaxRestarts",
                "RestartJob",
                "RestartJobAndIgnoreMaxRestarts",
            ),
            "onJobFailureReasons": ListOf(STR),
            "onJobFailureMessagePatterns": ListOf(STR),
            "targetReplicatedJobs": ListOf(STR),
        },
        required=("name", "action"),
    ),
    "StartupPolicy": Obj(
        {"startupPolicyOrder": enum("AnyOrder", "InOrder")}, required=("startupPolicyOrder",)
    ),
    "Coordinator": Obj(
        {"replicatedJob": STR, "jobIndex": NON_NEG, "podIndex": NON_NEG},
        required=("replicatedJob",),
    ),
    # batch/v1 (the Job template inside a ReplicatedJob)
    "JobTemplateSpec": Obj({"metadata": Ref("ObjectMeta"), "spec": Ref("JobSpec")}),
    "JobSpec": Obj(
        {
            "parallelism": NON_NEG,
            "completions": NON_NEG,
            "completionMode": enum("NonIndexed", "Indexed"),
            "backoffLimit": NON_NEG,
            "backoffLimitPerIndex": NON_NEG,
            "maxFailedIndexes": NON_NEG,
            "activeDeadlineSeconds": Scalar("integer", minimum=1),
            "ttlSecondsAfterFinished": NON_NEG,
            "suspend": BOOL,
            "podReplacementPolicy": enum("TerminatingOrFailed", "Failed"),
            "successPolicy": Ref("JobSuccessPolicy"),
            "template": Ref("PodTemplateSpec"),
        },
        required=("template",),
    ),
    "JobSuccessPolicy": Obj(
        {"rules": ListOf(Ref("JobSuccessPolicyRule"), min_items=1, max_items=20)},
        required=("rules",),
    ),
    "JobSuccessPolicyRule": Obj(
        {"succeededIndexes": INDEXES, "succeededCount": Scalar("integer", minimum=1)},
        at_least_one=("succeededIndexes", "succeededCount"),
    ),
    # core/v1: the pod
    "PodTemplateSpec": Obj(
        {"metadata": Ref("ObjectMeta"), "spec": Ref("PodSpec")}, required=("spec",)
    ),
    "PodSpec": Obj(
        {
            "containers": ListOf(Ref("Container"), min_items=1),
            "initContainers": ListOf(Ref("Container")),
            "volumes": ListOf(Ref("Volume")),
            "nodeSelector": MapOf(LABEL_VALUE, key=QUALIFIED_NAME),
            "tolerations": ListOf(Ref("Toleration")),
            "hostNetwork": BOOL,
            "dnsPolicy": enum("ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"),
            "restartPolicy": enum("Always", "OnFailure", "Never"),
            "serviceAccountName": DNS_SUBDOMAIN,
            "hostname": DNS_LABEL,
            "subdomain": DNS_LABEL,
            "terminationGracePeriodSeconds": NON_NEG,
            "priorityClassName": STR,
            "schedulerName": STR,
        },
        required=("containers",),
    ),
    "Container": Obj(
        {
            "name": DNS_LABEL,
            "image": STR,
            "imagePullPolicy": enum("Always", "IfNotPresent", "Never"),
            "command": ListOf(STR),
            "args": ListOf(STR),
            "workingDir": STR,
            "env": ListOf(Ref("EnvVar")),
            "ports": ListOf(Ref("ContainerPort")),
            "resources": Ref("ResourceRequirements"),
            "volumeMounts": ListOf(Ref("VolumeMount")),
        },
        required=("name",),
    ),
    "ContainerPort": Obj(
        {
            "name": PORT_NAME,
            "containerPort": PORT,
            "hostPort": PORT,
            "hostIP": STR,
            "protocol": PROTOCOL,
        },
        required=("containerPort",),
    ),
    "EnvVar": Obj(
        {"name": ENV_NAME, "value": STR, "valueFrom": Ref("EnvVarSource")},
        required=("name",),
        at_most_one=("value", "valueFrom"),
    ),
    "EnvVarSource": Obj(
        {
            "fieldRef": Ref("ObjectFieldSelector"),
            "configMapKeyRef": Ref("KeySelector"),
            "secretKeyRef": Ref("KeySelector"),
        },
        exactly_one=("fieldRef", "configMapKeyRef", "secretKeyRef"),
    ),
    "ObjectFieldSelector": Obj({"apiVersion": STR, "fieldPath": STR}, required=("fieldPath",)),
    "KeySelector": Obj({"name": STR, "key": STR, "optional": BOOL}, required=("key",)),
    "ResourceRequirements": Obj(
        {
            "requests": MapOf(QUANTITY, key=QUALIFIED_NAME),
            "limits": MapOf(QUANTITY, key=QUALIFIED_NAME),
        }
    ),
    "VolumeMount": Obj(
        {"name": STR, "mountPath": ABS_PATH, "readOnly": BOOL, "subPath": STR},
        required=("name", "mountPath"),
    ),
    "Volume": Obj(
        {
            "name": DNS_LABEL,
            "configMap": Ref("ConfigMapVolumeSource"),
            "secret": Ref("SecretVolumeSource"),
            "persistentVolumeClaim": Ref("PersistentVolumeClaimVolumeSource"),
            "csi": Ref("CSIVolumeSource"),
            "emptyDir": Ref("EmptyDirVolumeSource"),
        },
        required=("name",),
        exactly_one=("configMap", "secret", "persistentVolumeClaim", "csi", "emptyDir"),
    ),
    "ConfigMapVolumeSource": Obj(
        {
            "name": DNS_SUBDOMAIN,
            "items": ListOf(Ref("KeyToPath")),
            "defaultMode": Scalar("integer", minimum=0, maximum=0o777),
            "optional": BOOL,
        }
    ),
    "SecretVolumeSource": Obj(
        {
            "secretName": DNS_SUBDOMAIN,
            "items": ListOf(Ref("KeyToPath")),
            "defaultMode": Scalar("integer", minimum=0, maximum=0o777),
            "optional": BOOL,
        }
    ),
    "KeyToPath": Obj(
        {"key": STR, "path": STR, "mode": Scalar("integer", minimum=0, maximum=0o777)},
        required=("key", "path"),
    ),
    "PersistentVolumeClaimVolumeSource": Obj(
        {"claimName": DNS_SUBDOMAIN, "readOnly": BOOL}, required=("claimName",)
    ),
    "CSIVolumeSource": Obj(
        {
            "driver": STR,
            "readOnly": BOOL,
            "fsType": STR,
            "volumeAttributes": MapOf(STR),
            "nodePublishSecretRef": Ref("LocalObjectReference"),
        },
        required=("driver",),
    ),
    "EmptyDirVolumeSource": Obj({"medium": enum("", "Memory"), "sizeLimit": QUANTITY}),
    "LocalObjectReference": Obj({"name": STR}),
    "Toleration": Obj(
        {
            "key": QUALIFIED_NAME,
            "operator": enum("Exists", "Equal"),
            "value": STR,
            "effect": enum("NoSchedule", "PreferNoSchedule", "NoExecute"),
            "tolerationSeconds": INT,
        }
    ),
}

KINDS: dict[tuple[str, str], str] = {
    ("v1", "Service"): "Service",
    ("v1", "ConfigMap"): "ConfigMap",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "JobSet",
}


# --- the checker ---------------------------------------------------------------------------


def validate(doc: Any) -> list[str]:
    """Every problem of one manifest, each as `path: message` (empty when it is valid)."""
    if not isinstance(doc, dict):
        return [f"<root>: a manifest is a mapping, got {type(doc).__name__}"]
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in KINDS:
        known = ", ".join(f"{a} {k}" for a, k in KINDS)
        return [f"<root>: apiVersion/kind {key[0]!r}/{key[1]!r} is not one of: {known}"]
    errors: list[str] = []
    _check(doc, Ref(KINDS[key]), "", errors)
    if not errors:
        _rules(doc, errors)
    return errors


def check(doc: Any) -> None:
    """Raise ManifestError naming every problem of `doc`."""
    errors = validate(doc)
    if errors:
        name = doc.get("kind", "manifest") if isinstance(doc, dict) else "manifest"
        raise ManifestError(f"invalid {name}:\n  " + "\n  ".join(errors))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check(value: Any, tp: Any, path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if isinstance(tp, Ref):
        tp = TYPES[tp.name]
    if isinstance(tp, Scalar):
        _check_scalar(value, tp, where, errors)
    elif isinstance(tp, ListOf):
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list, got {_kind(value)}")
            return
        if len(value) < tp.min_items:
            errors.append(f"{where}: needs at least {tp.min_items} item(s)")
        if tp.max_items is not None and len(value) > tp.max_items:
            errors.append(f"{where}: at most {tp.max_items} item(s), got {len(value)}")
        for i, item in enumerate(value):
            _check(item, tp.item, f"{path}[{i}]", errors)
    elif isinstance(tp, MapOf):
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a mapping, got {_kind(value)}")
            return
        for k, v in value.items():
            _check_scalar(k, tp.key or STR, f"{where} key {k!r}", errors)
            _check(v, tp.value, _join(path, str(k)), errors)
    elif isinstance(tp, Obj):
        _check_obj(value, tp, path, errors)
    else:  # pragma: no cover - a bug in TYPES
        raise TypeError(f"unknown schema node {tp!r}")


def _check_obj(value: Any, tp: Obj, path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if not isinstance(value, dict):
        errors.append(f"{where}: expected a mapping, got {_kind(value)}")
        return
    for k in value:
        if k not in tp.fields:
            close = [f for f in tp.fields if _similar(str(k), f)]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            errors.append(f"{where}: unknown field {k!r}{hint}")
    for k in tp.required:
        if k not in value:
            errors.append(f"{where}: missing required field {k!r}")
    for k, const in tp.consts.items():
        if k in value and value[k] != const:
            errors.append(f"{_join(path, k)}: must be {const!r}, got {value[k]!r}")
    present = [k for k in tp.exactly_one if k in value]
    if tp.exactly_one and len(present) != 1:
        errors.append(f"{where}: exactly one of {list(tp.exactly_one)} is needed, got {present}")
    if tp.at_least_one and not any(k in value for k in tp.at_least_one):
        errors.append(f"{where}: needs at least one of {list(tp.at_least_one)}")
    both = [k for k in tp.at_most_one if k in value]
    if len(both) > 1:
        errors.append(f"{where}: at most one of {list(tp.at_most_one)}, got {both}")
    for k, v in value.items():
        if k in tp.fields:
            _check(v, tp.fields[k], _join(path, k), errors)


def _check_scalar(value: Any, tp: Scalar, where: str, errors: list[str]) -> None:
    ok = {
        "string": isinstance(value, str),
        "boolean": isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "quantity": isinstance(value, str | int) and not isinstance(value, bool),
        "int-or-string": isinstance(value, str | int) and not isinstance(value, bool),
    }[tp.kind]
    if not ok:
        errors.append(f"{where}: expected {tp.kind}, got {_kind(value)} {value!r}")
        return
    if tp.enum and value not in tp.enum:
        errors.append(f"{where}: {value!r} is not one of {list(tp.enum)}")
    if tp.pattern and isinstance(value, str) and not re.match(tp.pattern, value):
        errors.append(f"{where}: {value!r} is not {tp.what or tp.pattern}")
    if tp.max_len is not None and isinstance(value, str) and len(value) > tp.max_len:
        errors.append(f"{where}: {value!r} is longer than {tp.max_len} characters")
    if isinstance(value, int):
        if tp.minimum is not None and value < tp.minimum:
            errors.append(f"{where}: {value} is below the minimum {tp.minimum}")
        if tp.maximum is not None and value > tp.maximum:
            errors.append(f"{where}: {value} is above the maximum {tp.maximum}")


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


def _similar(a: str, b: str) -> bool:
    """A cheap typo detector: same letters give or take one edit."""
    a, b = a.lower(), b.lower()
    if abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b, strict=True)) <= 1 or sorted(a) == sorted(b)
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


# --- cross-field rules ---------------------------------------------


def _rules(doc: dict, errors: list[str]) -> None:
    if doc["kind"] == "JobSet":
        jobs = doc["spec"]["replicatedJobs"]
        names = [j["name"] for j in jobs]
        if len(set(names)) != len(names):
            errors.append(f"spec.replicatedJobs: names repeat: {names}")
        for i, job in enumerate(jobs):
            path = f"spec.replicatedJobs[{i}].template.spec"
            spec = job["template"].get("spec", {})
            if "successPolicy" in spec and spec.get("completionMode") != "Indexed":
                errors.append(f"{path}.successPolicy: needs completionMode Indexed")
            if "template" in spec:
                _pod_rules(spec["template"]["spec"], f"{path}.template.spec", errors)


def _pod_rules(pod: dict, path: str, errors: list[str]) -> None:
    volumes = [v["name"] for v in pod.get("volumes", [])]
    if len(set(volumes)) != len(volumes):
        errors.append(f"{path}.volumes: names repeat: {volumes}")
    containers = pod["containers"] + pod.get("initContainers", [])
    names = [c["name"] for c in containers]
    if len(set(names)) != len(names):
        errors.append(f"{path}.containers: names repeat: {names}")
    if pod.get("hostNetwork") and pod.get("dnsPolicy", "ClusterFirst") == "ClusterFirst":
        errors.append(
            f"{path}.dnsPolicy: a hostNetwork pod needs ClusterFirstWithHostNet to resolve "
            "cluster names (ClusterFirst falls back to the node's resolver)"
        )
    for i, c in enumerate(pod["containers"]):
        where = f"{path}.containers[{i}]"
        for j, m in enumerate(c.get("volumeMounts", [])):
            if m["name"] not in volumes:
                errors.append(f"{where}.volumeMounts[{j}]: no volume named {m['name']!r}")
        res = c.get("resources", {})
        requests, limits = res.get("requests", {}), res.get("limits", {})
        for name in set(requests) | set(limits):
            if "/" not in name or name.startswith("kubernetes.io/"):
                continue
            # Extended resources (google.com/tpu) are not overcommitted: a limit is needed and
            # a request, when given, must equal it.
            if name not in limits or (name in requests and requests[name] != limits[name]):
                errors.append(
                    f"{where}.resources: extended resource {name!r} needs a limit and any "
                    f"request equal to it, got {requests.get(name)!r} / {limits.get(name)!r}"
                )
