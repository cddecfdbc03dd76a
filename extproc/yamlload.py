"""yamlload: YAML for configuration files, where a key given twice is an error.

PyYAML's safe loader keeps the last of two equal keys without a word, so a file that sets
``max_concurrency`` twice runs with whichever came last. ``load`` refuses it instead.
"""

from __future__ import annotations

from typing import Any

import yaml


class DuplicateKeyError(yaml.YAMLError):
    """DuplicateKeyError is a mapping that holds one key twice; ``line`` is 1-based."""

    def __init__(self, key: Any, line: int, first_line: int) -> None:
        super().__init__(f"key {key!r} appears twice in one mapping (lines {first_line} and {line})")
        self.key, self.line, self.first_line = key, line, first_line


class _Loader(yaml.SafeLoader):
    """_Loader is PyYAML's safe loader that checks every mapping for repeated keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        self.flatten_mapping(node)  # merge keys (<<) may repeat what they merge: allowed
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base loader reports an unhashable key itself
            line = key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKeyError(key, line, first[key])
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """load decodes one YAML document like ``yaml.safe_load``; raises DuplicateKeyError for a repeated key."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
