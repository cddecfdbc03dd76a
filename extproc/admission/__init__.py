"""admission: the pure admission core (slots, token buckets, KV budget, adaptive scale, tenants)."""

from extproc.admission.types import (Demand, Outcome, PoolSignals, PoolSnapshot, RateInfo, Reason,
                                     Rejection)

__all__ = ["Demand", "Outcome", "PoolSignals", "PoolSnapshot", "RateInfo", "Reason", "Rejection"]
