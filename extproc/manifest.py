"""manifest: the file a Kubernetes ConfigMap manifest carries, read as that file.

The ConfigMaps of ``deploy/k8s/`` carry kvgate's file under the data key ``kvgate.yaml`` and
Envoy's under ``envoy.yaml``; ``kvgate check-config`` takes such a manifest where it takes
the file, so that the file an operator is about to apply is the one checked.
"""

from __future__ import annotations

from typing import Any

import yaml

from extproc import yamlload
from extproc.errors import ConfigError


def is_configmap(doc: Any) -> bool:
    """is_configmap tells a ConfigMap manifest (``kind: ConfigMap`` with ``data``) from a file."""
    return isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and isinstance(doc.get("data"), dict)


def unwrap(doc: Any, key: str) -> tuple[Any, str]:
    """unwrap returns the document a ConfigMap manifest carries under ``data[key]``, parsed,
    and where it came from (``ConfigMap NAME, data.KEY``); any other document unchanged, with
    an empty description. Raises ``ConfigError`` when the manifest has no such entry or the
    entry is no YAML (a key given twice included)."""
    if not is_configmap(doc):
        return doc, ""
    name = (doc.get("metadata") or {}).get("name", "?")
    where = f"ConfigMap {name}, data.{key}"
    text = doc["data"].get(key)
    if not isinstance(text, str):
        raise ConfigError(f"data.{key}", f"ConfigMap {name} carries no such file "
                                         f"(its data keys: {', '.join(sorted(doc['data'])) or 'none'})")
    try:
        return yamlload.load(text), where
    except yaml.YAMLError as exc:
        raise ConfigError(f"data.{key}", f"is not valid YAML: {exc}") from None
