"""A small kustomize: resources, configMapGenerator, strategic-merge patch files.

It understands exactly the subset the shipped kustomizations use and refuses anything
else, so the files stay valid for `kubectl kustomize` too."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.checkconfig.common import ConfigError, Manifest, dig

KUSTOMIZATION_FILENAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KUSTOMIZATION_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}
)
SUPPORTED_GENERATOR_KEYS = frozenset({"name", "behavior", "literals", "files"})

# The patchMergeKey of the Kubernetes lists a strategic-merge patch merges instead of replacing
# (from the API's struct tags); every other list is replaced, as Kubernetes does.
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"})


@dataclass
class _Layer:
    manifests: list[Manifest] = field(default_factory=list)
    # ConfigMaps made by a generator: their final name gets a content-hash suffix.
    generated: set[str] = field(default_factory=set)


def render_kustomization(directory: Path) -> list[Manifest]:
    """The manifests `kubectl kustomize directory` prints, as dicts, in resource order."""
    layer = _build_layer(directory.resolve())
    return _add_name_suffixes(layer)


def _load_kustomization(directory: Path) -> Mapping[str, Any]:
    for filename in KUSTOMIZATION_FILENAMES:
        path = directory / filename
        if path.is_file():
            try:
                loaded = yaml.safe_load(path.read_text())
            except (OSError, yaml.YAMLError) as error:
                raise ConfigError(f"{path}: {_one_line(error)}") from error
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: not a mapping")
            unsupported = set(loaded) - SUPPORTED_KUSTOMIZATION_KEYS
            if unsupported:
                raise ConfigError(f"{path}: unsupported kustomization fields {sorted(unsupported)}")
            return loaded
    raise ConfigError(f"{directory}: no kustomization file")


def _load_manifests(path: Path) -> list[Manifest]:
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {_one_line(error)}") from error
    manifests: list[Manifest] = []
    for document in documents:
        if document is None:
            continue
        if not isinstance(document, dict) or not isinstance(document.get("kind"), str):
            raise ConfigError(f"{path}: a document is not a Kubernetes object (no kind)")
        if not isinstance(dig(document, "metadata.name"), str):
            # kustomize refuses it too; every lookup here is by kind and name.
            raise ConfigError(f"{path}: a {document['kind']} has no metadata.name")
        manifests.append(document)
    return manifests


def _one_line(error: Exception) -> str:
    """A YAML error's text (problem, then where) on one line."""
    return " ".join(str(error).split())


def _entries(mapping: Mapping[str, Any], key: str, where: Path) -> list[Any]:
    """A list-valued field; absent or null is empty, anything else but a list is refused."""
    value = mapping.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{where}: {key} is not a list")
    return value


def _build_layer(directory: Path) -> _Layer:
    kustomization = _load_kustomization(directory)
    layer = _Layer()
    for entry in _entries(kustomization, "resources", directory):
        path = (directory / entry).resolve()
        if path.is_dir():
            child = _build_layer(path)
            layer.manifests.extend(child.manifests)
            layer.generated |= child.generated
        else:
            layer.manifests.extend(_load_manifests(path))
    for generator in _entries(kustomization, "configMapGenerator", directory):
        _apply_config_map_generator(directory, generator, layer)
    for patch_entry in _entries(kustomization, "patches", directory):
        if not isinstance(patch_entry, dict) or set(patch_entry) != {"path"}:
            raise ConfigError(f"{directory}: only `patches: - path: <file>` is supported")
        for patch in _load_manifests(directory / patch_entry["path"]):
            target = find_manifest(layer.manifests, patch["kind"], patch["metadata"]["name"])
            if target is None:
                raise ConfigError(
                    f"{directory}: patch {patch_entry['path']} matches no "
                    f"{patch['kind']}/{patch['metadata']['name']}"
                )
            layer.manifests[layer.manifests.index(target)] = strategic_merge(target, patch)
    return layer


def find_manifest(manifests: Iterable[Manifest], kind: str, name: str) -> Manifest | None:
    for manifest in manifests:
        if manifest.get("kind") == kind and dig(manifest, "metadata.name") == name:
            return manifest
    return None


def _apply_config_map_generator(
    directory: Path, generator: Mapping[str, Any], layer: _Layer
) -> None:
    if not isinstance(generator, dict) or not isinstance(generator.get("name"), str):
        raise ConfigError(f"{directory}: a configMapGenerator entry has no name")
    unsupported = set(generator) - SUPPORTED_GENERATOR_KEYS
    if unsupported:
        raise ConfigError(
            f"{directory}: unsupported configMapGenerator fields {sorted(unsupported)}"
        )
    name = generator["name"]
    data: dict[str, str] = {}
    for literal in _entries(generator, "literals", directory):
        key, separator, value = str(literal).partition("=")
        if not separator:
            raise ConfigError(f"{directory}: literal {literal!r} is not KEY=VALUE")
        data[key] = value
    for file_entry in _entries(generator, "files", directory):
        key, separator, relative = str(file_entry).partition("=")
        if not separator:
            key, relative = Path(file_entry).name, str(file_entry)
        data[key] = (directory / relative).read_text()
    behavior = generator.get("behavior", "create")
    existing = find_manifest(layer.manifests, "ConfigMap", name)
    if behavior == "create":
        if existing is not None:
            raise ConfigError(f"{directory}: ConfigMap {name} already exists (use behavior: merge)")
        layer.manifests.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
        )
        layer.generated.add(name)
    elif behavior in ("merge", "replace"):
        if existing is None or name not in layer.generated:
            raise ConfigError(f"{directory}: no generated ConfigMap {name} to {behavior}")
        merged = copy.deepcopy(existing)
        merged["data"] = {**existing.get("data", {}), **data} if behavior == "merge" else data
        layer.manifests[layer.manifests.index(existing)] = merged
    else:
        raise ConfigError(f"{directory}: unknown configMapGenerator behavior {behavior!r}")


def strategic_merge(base: Any, patch: Any, list_key: str | None = None) -> Any:
    """Kubernetes strategic-merge patch for built-in kinds: maps merge, `null` deletes a key,
    lists with a patchMergeKey (containers, env, ...) merge item by item, other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    merge_key = STRATEGIC_MERGE_KEYS.get(list_key or "")
    if isinstance(base, list) and isinstance(patch, list) and merge_key is not None:
        result = [copy.deepcopy(item) for item in base]
        for item in patch:
            position = next(
                (i for i, old in enumerate(result) if old.get(merge_key) == item.get(merge_key)),
                None,
            )
            if position is None:
                result.append(copy.deepcopy(item))
            else:
                result[position] = strategic_merge(result[position], item)
        return result
    return copy.deepcopy(patch)


def _kustomize_hash_suffix(config_map: Manifest) -> str:
    """kustomize's name suffix: sha256 of the Go-JSON encoding of kind, name and data, the
    first 10 hex digits with 0, 1, 3, a, e swapped for letters (no accidental words/numbers).

    kustomize v5 looks the name up with a path that never matches ("metadata/name" as one
    key), so it hashes an empty name; doing the same keeps the names identical to its output.
    """
    encoded = json.dumps(
        {"data": config_map.get("data", {}), "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    # Go's encoding/json escapes these three; the hash is over Go's bytes.
    encoded = encoded.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _add_name_suffixes(layer: _Layer) -> list[Manifest]:
    renamed: dict[str, str] = {}
    manifests = copy.deepcopy(layer.manifests)
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        if manifest["kind"] == "ConfigMap" and name in layer.generated:
            renamed[name] = f"{name}-{_kustomize_hash_suffix(manifest)}"
            manifest["metadata"]["name"] = renamed[name]
    for manifest in manifests:
        pod_spec = dig(manifest, "spec.template.spec")
        if manifest["kind"] in POD_TEMPLATE_KINDS and isinstance(pod_spec, dict):
            _rename_config_map_references(pod_spec, renamed)
    return manifests


def _rename_config_map_references(pod_spec: Manifest, renamed: Mapping[str, str]) -> None:
    def rename(reference: Any) -> None:
        if isinstance(reference, dict) and reference.get("name") in renamed:
            reference["name"] = renamed[reference["name"]]

    # A field written with no value (`env:`) is null in YAML, and empty to Kubernetes.
    containers = _mappings(pod_spec.get("containers")) + _mappings(pod_spec.get("initContainers"))
    for container in containers:
        for source in _mappings(container.get("envFrom")):
            rename(source.get("configMapRef"))
        for variable in _mappings(container.get("env")):
            rename(dig(variable, "valueFrom.configMapKeyRef"))
    for volume in _mappings(pod_spec.get("volumes")):
        rename(volume.get("configMap"))
        for source in _mappings(dig(volume, "projected.sources")):
            rename(source.get("configMap"))


def _mappings(items: Any) -> list[Manifest]:
    """The mappings of a list field; null or malformed entries are left to the readers that
    need them (sources.py), which name the problem."""
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
