"""Validating deploy/ offline, the way the API server would.

Standard Kubernetes objects: ``kubernetes-validate --strict`` (the OpenAPI schemas of Kubernetes itself).
KubeRay objects: the openAPIV3Schema of KubeRay's CRDs (../shared/crds, copied unchanged from KubeRay) with
``jsonschema``, plus what ``kubectl apply --validate=strict`` adds: a field the schema does not declare is
an error (unless the schema preserves unknown fields there).
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CRDS = ROOT.parent / "shared" / "crds"
CRD_FILES = {("ray.io/v1", "RayCluster"): "ray.io_rayclusters.yaml", ("ray.io/v1", "RayService"): "ray.io_rayservices.yaml"}


def load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The CRD's schema for ``kind`` (read-only: shared by every caller). Parsed once per session: a CRD is ~1 MB
    of YAML (seconds for the pure-Python parser on each call); libyaml's safe loader, where there is one, gives
    the same objects."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / CRD_FILES[(api_version, kind)]).read_text(), Loader=loader)  # noqa: S506 (a safe loader)
    version = api_version.split("/")[1]
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)


def unknown_fields(instance: Any, schema: dict, path: str = "") -> Iterator[str]:
    """Paths of fields the structural schema does not declare (the API server's strict field validation)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(instance, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            if props is not None and key in props:
                yield from unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None and extra is not True:
                yield f"{path}.{key}"
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(instance):
            yield from unknown_fields(item, schema["items"], f"{path}[{i}]")


def crd_errors(obj: dict) -> list[str]:
    """Every reason the API server would refuse ``obj`` (a KubeRay custom resource); [] if valid."""
    schema = crd_schema(obj["apiVersion"], obj["kind"])
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]
    errors += [f"{p}: unknown field" for p in unknown_fields(obj, schema)]
    return errors


def k8s_errors(obj: dict, version: str = "1.37.0") -> list[str]:
    """kubernetes-validate --strict on one standard object; [] if valid."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [str(e.message)]
    return []
