"""The part of kustomize that infra/k8s uses, so that tests can validate what
`kubectl apply -k` would send without a kubectl: resources (files and folders), namespace,
images, and patches as JSON patches (RFC 6902) with a kind/name target."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import yaml

CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "APIService",
}
KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}


def render(folder: Path) -> list[dict]:
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_KEYS
    assert not unknown, f"{folder}: kustomization keys this renderer does not know: {unknown}"
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs = copy.deepcopy(docs)
    for doc in docs:
        if "namespace" in spec and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = spec["namespace"]
        for image in spec.get("images", []):
            _set_image(doc, image)
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((folder / patch["path"]).read_text())
        target = patch["target"]
        hits = [
            i
            for i, d in enumerate(docs)
            if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]
        assert hits, f"{folder}: patch {patch['path']} matches nothing"
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], ops)
    return docs


def containers(doc: dict) -> list[dict]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def _set_image(doc: dict, image: dict) -> None:
    for container in containers(doc):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name
