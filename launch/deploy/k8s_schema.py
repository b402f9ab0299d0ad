"""Checks the manifests `simloop gke render` writes against the published Kubernetes object models.

    errors = validate(doc)   # [] or ["JobSet.spec.replicatedJobs[0].replicas: expected int, ..."]
    check(doc)               # raises ManifestError naming the document and every error

Service, ConfigMap, and the batch/v1 Job template inside each of a JobSet's replicatedJobs are
walked field by field against the model classes of the official `kubernetes` Python client,
which are generated from the API server's OpenAPI document: a model's `attribute_map` gives its
JSON field names, `openapi_types` their types (`str`, `int`, `bool`, `V1Container`,
`list[V1EnvVar]`, `dict(str, str)`, `object` = anything), and its required fields are the ones it
cannot be built without. An unknown field (a typo the API server would drop or refuse), a wrong
type and a missing required field are errors. The client types resource.Quantity as `str`, but
the API server takes a JSON number as well (render writes `google.com/tpu: 8`), so the quantity
fields in `QUANTITIES` take both. kubernetes>=37 generates pydantic models, older releases plain
classes; both work, and >=30 is needed for the Job `successPolicy` that render writes.

The JobSet is a CRD (jobset.x-k8s.io/v1alpha2): neither the client nor PyPI has a model of it
(the SDK in kubernetes-sigs/jobset sdk/python is not published), so `JOBSET` below describes its
own fields by hand, from sigs.k8s.io/jobset api/jobset/v1alpha2/jobset_types.go (required =
no `omitempty`; enums from its `+kubebuilder:validation:Enum` markers); metadata, Job templates
and PVC templates inside it are checked against the client's models.

Only `validate` imports `kubernetes` (about 0.5 s), so `simloop --help` and config checks don't.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any


class ManifestError(ValueError):
    """A rendered manifest that the API server would reject or silently change."""


KINDS = {
    ("v1", "Service"): "V1Service",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "JobSet",
}

# The JobSet's own types: {JSON field: type}, required fields. Types use the client's notation;
# "A|B" is an enum of strings.
JOBSET: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {
    "JobSet": (
        {"apiVersion": "str", "kind": "str", "metadata": "V1ObjectMeta", "spec": "JobSetSpec"},
        ("apiVersion", "kind", "metadata", "spec"),
    ),
    "JobSetSpec": (
        {
            "replicatedJobs": "list[ReplicatedJob]",
            "network": "Network",
            "successPolicy": "SuccessPolicy",
            "failurePolicy": "FailurePolicy",
            "startupPolicy": "StartupPolicy",
            "suspend": "bool",
            "coordinator": "Coordinator",
            "managedBy": "str",
            "ttlSecondsAfterFinished": "int",
            "volumeClaimPolicies": "list[VolumeClaimPolicy]",
        },
        (),
    ),
    "ReplicatedJob": (
        {
            "name": "str",
            "groupName": "str",
            "template": "V1JobTemplateSpec",
            "replicas": "int",
            "dependsOn": "list[DependsOn]",
        },
        ("name", "template"),
    ),
    "DependsOn": ({"name": "str", "status": "Ready|Complete"}, ("name", "status")),
    "Network": (
        {"enableDNSHostnames": "bool", "subdomain": "str", "publishNotReadyAddresses": "bool"},
        (),
    ),
    "SuccessPolicy": (
        {"operator": "All|Any", "targetReplicatedJobs": "list[str]"},
        ("operator",),
    ),
    "FailurePolicy": (
        {
            "maxRestarts": "int",
            "restartStrategy": "Recreate|BlockingRecreate|InPlaceRestart",
            "rules": "list[FailurePolicyRule]",
        },
        (),
    ),
    "FailurePolicyRule": (
        {
            "name": "str",
            "action": "FailJobSet|RestartJobSet|RestartJobSetAndIgnoreMaxRestarts|RestartJob"
            "|RestartJobAndIgnoreMaxRestarts",
            "onJobFailureReasons": "list[str]",
            "onJobFailureMessagePatterns": "list[str]",
            "targetReplicatedJobs": "list[str]",
        },
        ("name", "action"),
    ),
    "StartupPolicy": ({"startupPolicyOrder": "AnyOrder|InOrder"}, ("startupPolicyOrder",)),
    "Coordinator": (
        {"replicatedJob": "str", "jobIndex": "int", "podIndex": "int"},
        ("replicatedJob",),
    ),
    "VolumeClaimPolicy": (
        {"templates": "list[V1PersistentVolumeClaim]", "retentionPolicy": "RetentionPolicy"},
        (),
    ),
    "RetentionPolicy": ({"whenDeleted": "Delete|Retain"}, ()),
}

# resource.Quantity fields (typed str by the client): a string such as 16Gi or a JSON number.
QUANTITIES = {
    ("V1ResourceRequirements", "limits"),
    ("V1ResourceRequirements", "requests"),
    ("V1VolumeResourceRequirements", "limits"),
    ("V1VolumeResourceRequirements", "requests"),
    ("V1PodSpec", "overhead"),
    ("V1EmptyDirVolumeSource", "sizeLimit"),
    ("V1ResourceFieldSelector", "divisor"),
}

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict\(str, (.+)\)$")
_SCALARS = {
    "str": (str,),
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "quantity": (str, int, float),
    "datetime": (str,),
    "date": (str,),
    "bytes": (str,),
}


def validate(doc: Any) -> list[str]:
    """Every problem of one manifest, each as `Kind.field.path: message` ([] when valid)."""
    if not isinstance(doc, dict):
        return [f"<manifest>: expected a mapping, got {_kind(doc)}"]
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in KINDS:
        known = ", ".join(f"{a}/{k}" for a, k in KINDS)
        return [f"<manifest>: apiVersion/kind {key[0]!r}/{key[1]!r} is not one of: {known}"]
    errors: list[str] = []
    _check(doc, KINDS[key], key[1], errors)
    return errors


def check(doc: Any) -> None:
    """Raise ManifestError naming the document and every problem of it."""
    errors = validate(doc)
    if errors:
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        kind = doc.get("kind") if isinstance(doc, dict) else None
        raise ManifestError(f"invalid {kind or 'manifest'} {name!r}:\n  " + "\n  ".join(errors))


def _check(value: Any, tp: str, path: str, errors: list[str]) -> None:
    if tp == "object":
        return
    if m := _LIST.match(tp):
        if not isinstance(value, list):
            errors.append(f"{path}: expected {tp}, got {_kind(value)}")
            return
        for i, item in enumerate(value):
            _check(item, m[1], f"{path}[{i}]", errors)
    elif m := _DICT.match(tp):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected {tp}, got {_kind(value)}")
            return
        for k, v in value.items():
            if not isinstance(k, str):
                errors.append(f"{path}: key {k!r} is a {_kind(k)}, expected str")
            _check(v, m[1], f"{path}[{str(k)!r}]", errors)
    elif tp in _SCALARS:
        ok = isinstance(value, _SCALARS[tp]) and (tp == "bool" or not isinstance(value, bool))
        if not ok:
            what = "str or number" if tp == "quantity" else tp
            errors.append(f"{path}: expected {what}, got {_kind(value)} {value!r}")
    elif "|" in tp:
        if value not in tp.split("|"):
            errors.append(f"{path}: {value!r} is not one of {tp.split('|')}")
    else:
        _check_object(value, tp, path, errors)


def _check_object(value: Any, tp: str, path: str, errors: list[str]) -> None:
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a {tp} mapping, got {_kind(value)}")
        return
    fields, required = _fields(tp)
    for k, v in value.items():
        if k in fields:
            _check(v, fields[k], f"{path}.{k}", errors)
            continue
        close = difflib.get_close_matches(str(k), fields, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"it has {', '.join(fields)}"
        errors.append(f"{path}: unknown field {k!r} of {tp} ({hint})")
    for k in required:
        if value.get(k) is None:
            errors.append(f"{path}: missing required field {k!r} of {tp}")


@functools.cache
def _fields(tp: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """{JSON field: type} and the required fields of a JobSet type or a client model."""
    if tp in JOBSET:
        return JOBSET[tp]
    from kubernetes.client import models

    cls = getattr(models, tp)
    fields = {key: _spelling(cls.openapi_types[attr]) for attr, key in cls.attribute_map.items()}
    for key in fields:
        if (tp, key) in QUANTITIES:  # a `str` or a `dict(str, str)` of them
            fields[key] = "quantity" if fields[key] == "str" else "dict(str, quantity)"
    return fields, tuple(cls.attribute_map[a] for a in _required_attrs(cls))


def _spelling(tp: str) -> str:
    """kubernetes>=37's `List[X]` / `Dict[str, X]` as the older `list[X]` / `dict(str, X)`."""
    if m := re.fullmatch(r"[lL]ist\[(.+)\]", tp):
        return f"list[{_spelling(m[1])}]"
    if m := re.fullmatch(r"Dict\[str, (.+)\]|dict\(str, (.+)\)", tp):
        return f"dict(str, {_spelling(m[1] or m[2])})"
    return tp


def _required_attrs(cls: type) -> list[str]:
    model_fields = getattr(cls, "model_fields", None)
    if model_fields is not None:  # kubernetes>=37: pydantic models
        return [a for a in cls.attribute_map if a in model_fields and model_fields[a].is_required()]
    # Older clients: the generated setters refuse None for a required field.
    from kubernetes.client import Configuration

    probe = cls.__new__(cls)
    probe.local_vars_configuration = Configuration()
    required = []
    for attr in cls.attribute_map:
        try:
            setattr(probe, attr, None)
        except ValueError:
            required.append(attr)
    return required


def _kind(value: Any) -> str:
    return {dict: "mapping", list: "list"}.get(type(value), type(value).__name__)
