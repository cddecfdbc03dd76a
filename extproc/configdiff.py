"""configdiff: what a new configuration changes against the one in force, and which of those
changes a hot reload refuses unless the new file says it is meant.

``config_change(old, new)`` is a pure function of the two validated configurations. Its
``ConfigChange`` lists every change in a fixed order, one phrase each (pools, backends,
classes and tenants added, removed or changed; a setting as ``key old -> new``; a tenant's
API keys by their count, never a digest; the store only as "changed", since its URL may hold a
password), and the *destructive* ones apart:

=============================================  ===============================================
destructive change                             what it does at once
=============================================  ===============================================
a pool removed                                 requests a route (or ``default_pool``) sends
                                               there fail: kvgate cannot see Envoy's routes
every backend of a pool removed (no DNS        a picking pool has no node to name (Envoy's
discovery either)                              plain-text 503); a pool-level one loses its
                                               signals
half or more of a pool's backends removed      half its capacity gone at once (a file cut in
(net of those added)                           the middle of its backends list looks so)
a pool that starts or stops picking its nodes  the Envoy file in front fits the other kind:
                                               every request fails (``envoyconf.picking_mismatch``)
a picking pool that starts naming fallbacks     an ORIGINAL_DST Envoy file in front (the
(``picking.fallbacks`` from 0)                 shipped ones) answers every list with 503
a tenant that had API keys removed             its requests become unauthenticated
every API key of a tenant removed              the same
a class removed                                its tenants, and the requests that named it,
                                               are served in another class
=============================================  ===============================================

A file cut short while it is written (or saved half by an editor, a full disk, a template)
is often still valid YAML and a valid configuration: cut after ``backends:`` a pool has none,
cut before the tenants every keyed tenant is gone. ``guard`` turns a destructive change into a
``DestructiveReload`` (a ``ConfigError``) unless the new file sets ``allow_destructive_reload:
true`` and the file in force did not: the key lets through the one reload that sets it, so
that a file left with it is guarded again from the next reload on. A restart applies any valid
file (a start is not a reload).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from extproc.config import Config, PoolConfig, TenantConfig
from extproc.errors import ConfigError

ALLOW_KEY = "allow_destructive_reload"

# Fields compared by their own rules below, not as settings.
_OWN_RULES = {"pools", "backends", "classes", "tenants", "store", "api_key_sha256", "name", ALLOW_KEY}


@dataclass(frozen=True, slots=True)
class ConfigChange:
    """ConfigChange is what a new configuration changes: ``changes``, one phrase per change in
    a fixed order; ``destructive``, the phrases of the changes a reload refuses unless told
    (each also in ``changes``)."""

    changes: tuple[str, ...]
    destructive: tuple[str, ...]

    def summary(self) -> str:
        """summary is the changes in one line, or ``no change in effect``."""
        return "; ".join(self.changes) if self.changes else "no change in effect"


class DestructiveReload(ConfigError):
    """DestructiveReload is a reload refused because it would remove pools, backends or keyed
    tenants (``ConfigChange.destructive``) and the new file does not allow it."""

    def __init__(self, change: ConfigChange, already_allowed: bool = False) -> None:
        how = (f"the file in force already set `{ALLOW_KEY}: true`, which lets through only "
               f"the reload that sets it: take the key out (a reload), then add it again for "
               f"this change, or restart kvgate" if already_allowed else
               f"if this is meant add `{ALLOW_KEY}: true` to the file (at its end, so that a cut "
               f"file never carries it) or restart kvgate")
        super().__init__(ALLOW_KEY, (
            f"the new file would {'; '.join(change.destructive)}; all it would change: "
            f"{change.summary()}. A file cut short while being written looks like this: fix it, "
            f"or {how}"))
        self.change = change


def guard(old: Config, new: Config) -> tuple[ConfigChange, DestructiveReload | None]:
    """guard is the change from ``old`` to ``new`` and, when it is destructive and ``new`` does
    not newly set ``allow_destructive_reload`` (``old`` did not), the refusal to report (None:
    apply it)."""
    change = config_change(old, new)
    if change.destructive and not (new.allow_destructive_reload and not old.allow_destructive_reload):
        return change, DestructiveReload(change, already_allowed=new.allow_destructive_reload)
    return change, None


def config_change(old: Config, new: Config) -> ConfigChange:
    """config_change lists what ``new`` changes against ``old`` (see the module doc)."""
    changes: list[str] = []
    destructive: list[str] = []

    def note(text: str, harmful: bool = False) -> None:
        changes.append(text)
        if harmful:
            destructive.append(text)

    added = [p for p in new.pools if p not in old.pools]
    removed = [p for p in old.pools if p not in new.pools]
    if added:
        note(f"pools added: {', '.join(added)}")
    for p in removed:
        note(f"remove pool {p!r} (a route or default_pool may name it)", harmful=True)
    for name in (p for p in old.pools if p in new.pools):
        _pool_change(old.pools[name], new.pools[name], note)
    for text in _settings("", old, new):
        note(text)
    if old.store != new.store:
        note("store changed (applies at a restart)")
    _class_change(old, new, note)
    _tenant_change(old.tenants.tenants, new.tenants.tenants, note)
    return ConfigChange(tuple(changes), tuple(destructive))


def _pool_change(old: PoolConfig, new: PoolConfig, note: Any) -> None:
    at = f"pools.{old.name}"
    before = {b.name: b for b in old.backends}
    after = {b.name: b for b in new.backends}
    gone = [b for b in before if b not in after]
    came = [b for b in after if b not in before]
    emptied = bool(before or old.discovery) and not (after or new.discovery)
    if emptied:
        note(f"remove every backend of pool {old.name!r} ({len(before)})", harmful=True)
    elif gone and not new.discovery and 2 * len(after) <= len(before):
        note(f"remove {len(before) - len(after)} of the {len(before)} backends of pool "
             f"{old.name!r}: {', '.join(gone)} ({len(after)} left)", harmful=True)
    elif gone:
        note(f"{at}: backends removed: {', '.join(gone)} ({len(after)} left)")
    if came:
        # Envoy's listed cluster (fallbacks) does not know a new node until its file is rewritten.
        listed = " (list them in Envoy's nodes cluster too: `kvgate envoy-filter`)" if new.picking.fallbacks else ""
        note(f"{at}: backends added: {', '.join(came)}{listed}")
    for name in (b for b in before if b in after and before[b] != after[b]):
        fields = [f.name for f in dataclasses.fields(before[name])
                  if getattr(before[name], f.name) != getattr(after[name], f.name)]
        note(f"{at}: backend {name} changed ({', '.join(fields)})")
    if old.picks != new.picks and not emptied:
        if new.picks:
            note(f"make pool {old.name!r} pick its nodes (the pool-level Envoy file in front "
                 f"would fail every request)", harmful=True)
        else:
            note(f"make pool {old.name!r} stop picking its nodes (its backends have no address; "
                 f"the picker Envoy file in front would fail every request)", harmful=True)
    if new.picks and old.picks and not old.picking.fallbacks and new.picking.fallbacks:
        note(f"make pool {old.name!r} name {new.picking.fallbacks} fallback(s) (an ORIGINAL_DST Envoy "
             f"file in front, as shipped, would answer every request 503; `kvgate envoy-filter` "
             f"writes the listed cluster they need)", harmful=True)
    for text in _settings(at, old, new):
        note(text)


def _class_change(old: Config, new: Config, note: Any) -> None:
    before, after = old.tenants.classes, new.tenants.classes
    added = [c for c in after if c not in before]
    removed = [c for c in before if c not in after]
    if added:
        note(f"classes added: {', '.join(added)}")
    for c in removed:
        note(f"remove class {c!r} (its tenants, and the requests that named it, would be served "
             f"in another class)", harmful=True)
    for name in (c for c in before if c in after):
        for text in _settings(f"tenants.classes.{name}", before[name], after[name]):
            note(text)


def _tenant_change(before: Mapping[str, TenantConfig], after: Mapping[str, TenantConfig],
                   note: Any) -> None:
    added = [t for t in after if t not in before]
    if added:
        keyed = sum(bool(after[t].api_key_sha256) for t in added)
        note(f"tenants added: {', '.join(added)}" + (f" ({keyed} with API keys)" if keyed else ""))
    plain_removed = []
    for name, tenant in before.items():
        if name in after:
            continue
        if tenant.api_key_sha256:
            note(f"remove tenant {name!r} and its {_keys(len(tenant.api_key_sha256))} (its requests "
                 f"would be unauthenticated)", harmful=True)
        else:
            plain_removed.append(name)
    if plain_removed:
        note(f"tenants removed: {', '.join(plain_removed)}")
    for name in (t for t in before if t in after):
        old, new = before[name], after[name]
        for text in _settings(f"tenants.tenants.{name}", old, new):
            note(text)
        old_keys, new_keys = set(old.api_key_sha256), set(new.api_key_sha256)
        if old_keys and not new_keys:
            note(f"remove every API key of tenant {name!r} ({len(old_keys)}; its requests would "
                 f"be unauthenticated)", harmful=True)
        elif old_keys != new_keys:
            note(f"tenant {name}: API keys {len(old_keys)} -> {len(new_keys)} "
                 f"({len(new_keys - old_keys)} added, {len(old_keys - new_keys)} removed)")


def _keys(n: int) -> str:
    return f"{n} API key" + ("" if n == 1 else "s")


def _settings(at: str, old: Any, new: Any) -> Iterator[str]:
    """_settings yields ``key old -> new`` for every plain setting of two dataclasses that
    differs, recursing into nested ones; the fields with their own rules are skipped."""
    for f in dataclasses.fields(old):
        if f.name in _OWN_RULES:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b:
            continue
        key = f"{at}.{f.name}" if at else f.name
        if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
            yield from _settings(key, a, b)
        elif (a is None) != (b is None) and dataclasses.is_dataclass(a if b is None else b):
            yield f"{key} {'added' if a is None else 'removed'}"
        else:
            yield f"{key} {_show(a)} -> {_show(b)}"


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "none" if value is None else str(value)
