"""configread: reading one mapping of a kvgate configuration file, with errors that name the key.

``Section`` reads typed values (integers, numbers, strings, booleans, nested sections),
each checked as it is read; ``config`` builds the typed configuration with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal, overload

from extproc.errors import ConfigError


class Section:
    """Section reads one mapping of the file, remembering its dotted key for errors.

    Every key read is remembered: ``done`` refuses the others (typos, unsupported settings).
    """

    __slots__ = ("key", "data", "seen")

    def __init__(self, key: str, data: Any) -> None:
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(key or "<root>", f"must be a mapping, got {type(data).__name__}")
        for k in data:
            if not isinstance(k, str):
                raise ConfigError(key or "<root>", f"keys must be strings, got {k!r}")
        self.key = key
        self.data = data
        self.seen: set[str] = set()

    def path(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def raw(self, name: str, default: Any = None) -> Any:
        self.seen.add(name)
        return self.data.get(name, default)

    def has(self, name: str) -> bool:
        return name in self.data

    def section(self, name: str) -> Section:
        return Section(self.path(name), self.raw(name))

    def _given(self, name: str, default: Any, optional: bool) -> Any:
        """_given is ``name``'s value, else ``default``; None only when neither is given and the
        key is ``optional`` (a required key missing raises ConfigError)."""
        value = self.raw(name, default)
        if value is None and not optional:
            raise ConfigError(self.path(name), "is required")
        return value

    @overload
    def integer(self, name: str, default: int | None, *, minimum: int = 1,
                optional: Literal[False] = False) -> int: ...

    @overload
    def integer(self, name: str, default: int | None, *, minimum: int = 1,
                optional: Literal[True]) -> int | None: ...

    def integer(self, name: str, default: int | None, *, minimum: int = 1,
                optional: bool = False) -> int | None:
        """integer reads an integer >= ``minimum`` (a whole float too); absent or null: the
        default, and with no default it is required unless ``optional`` (then None)."""
        value = self._given(name, default, optional)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.path(name), f"must be an integer, got {value!r}")
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(self.path(name), f"must be an integer, got {value!r}")
            value = int(value)
        if value < minimum:
            raise ConfigError(self.path(name), f"must be >= {minimum}, got {value}")
        return value

    def number(self, name: str, default: float, *, low: float | None = None,
               high: float | None = None, low_open: bool = False) -> float:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(self.path(name), f"must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(self.path(name), f"must be finite, got {value}")
        if low is not None and (value <= low if low_open else value < low):
            raise ConfigError(self.path(name), f"must be {'>' if low_open else '>='} {low}, got {value}")
        if high is not None and value > high:
            raise ConfigError(self.path(name), f"must be <= {high}, got {value}")
        return value

    @overload
    def string(self, name: str, default: str | None, *, choices: tuple[str, ...] = (),
               optional: Literal[False] = False) -> str: ...

    @overload
    def string(self, name: str, default: str | None, *, choices: tuple[str, ...] = (),
               optional: Literal[True]) -> str | None: ...

    def string(self, name: str, default: str | None, *, choices: tuple[str, ...] = (),
               optional: bool = False) -> str | None:
        """string reads a non-empty string, one of ``choices`` when given; absent or null: the
        default, and with no default it is required unless ``optional`` (then None)."""
        value = self._given(name, default, optional)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(self.path(name), f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise ConfigError(self.path(name), f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise ConfigError(self.path(name), f"must be true or false, got {value!r}")
        return value

    def done(self) -> None:
        """done refuses keys nobody read: they are typos or unsupported settings."""
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            raise ConfigError(self.path(unknown[0]), "unknown key")
