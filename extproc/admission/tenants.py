"""tenants: which class a request belongs to, and each tenant's own token bucket.

A tenant has one class; a class has a priority, guaranteed slots (per pool), an optional
TPM per tenant of the class, a bounded wait and a ``sheddable`` flag. A tenant's bucket
holds ``tenant.tpm`` tokens per minute, or its class's ``tpm`` when the tenant sets none;
buckets are per (pool, tenant), like a provider's per-model limits. Tenant buckets are not
scaled by the adaptive scale: they are a fairness contract between tenants, while the
pool's bucket, slots and KV budget carry the protection of the GPUs.
"""

from __future__ import annotations

from extproc.admission.bucket import tpm_rate
from extproc.admission.types import BucketSpec
from extproc.config import ClassConfig, TenantsConfig

# The bucket read of a tenant whose spec is not cached: a spec no tenant has, so that a
# cache read is one lookup and its result keeps its type.
NOT_CACHED = BucketSpec(key="", capacity=0.0, rate=0.0, base_capacity=0.0)


class Tenants:
    """Tenants resolves class names and tenant buckets from one ``TenantsConfig``.

    Names are configured names. A class name the configuration does not know (a demand
    built before a reload that removed its class) resolves to the default class.
    """

    __slots__ = ("config", "classes", "default", "buckets", "guaranteed", "kv_watermarks")

    def __init__(self, config: TenantsConfig) -> None:
        self.config = config
        self.classes = config.classes
        self.default: ClassConfig = config.classes[config.default_class]
        # Tenant name -> its bucket spec, for configured tenants (read directly on the hot path).
        self.buckets: dict[str, BucketSpec | None] = {}
        self.guaranteed: dict[str, int] = {
            name: c.guaranteed_slots for name, c in config.classes.items() if c.guaranteed_slots > 0}
        # Class name -> its KV watermark, for the classes held below the whole KV budget.
        self.kv_watermarks: dict[str, float] = {
            name: c.kv_watermark for name, c in config.classes.items() if c.kv_watermark < 1.0}

    def class_rule(self, class_name: str) -> ClassConfig:
        """class_rule is the configured class ``class_name``, or the default class."""
        c = self.config.classes.get(class_name)
        return c if c is not None else self.default

    def weight(self, flow: str) -> float:
        """weight is a flow's share of its class's turns in the wait queue: a configured
        tenant's ``weight``, 1.0 for any other name (anonymous flows among them)."""
        known = self.config.tenants.get(flow)
        return 1.0 if known is None else known.weight

    def tpm_of(self, tenant: str, class_name: str) -> int | None:
        """tpm_of is the tenant's tokens per minute: its own, else its class's, else None."""
        known = self.config.tenants.get(tenant)
        if known is not None and known.tpm is not None:
            return known.tpm
        return self.class_rule(class_name).tpm

    def bucket(self, tenant: str, class_name: str) -> BucketSpec | None:
        """bucket is the spec of the tenant's own bucket (None: the tenant has no TPM).

        Specs of configured tenants are cached; other names are computed each time so
        that the cache stays bounded by the configuration.
        """
        spec = self.buckets.get(tenant, NOT_CACHED)
        if spec is not NOT_CACHED:
            return spec
        tpm = self.tpm_of(tenant, class_name)
        spec = None if tpm is None else BucketSpec(key="tenant:" + tenant, capacity=float(tpm),
                                                   rate=tpm_rate(tpm), base_capacity=float(tpm))
        known = self.config.tenants.get(tenant)
        if known is not None and known.class_name == class_name:
            self.buckets[tenant] = spec
        return spec
