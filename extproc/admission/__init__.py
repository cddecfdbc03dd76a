"""admission: the pure admission core: slots, token buckets, KV budget, adaptive scale, tenants.

No gRPC, HTTP or Prometheus here; time comes from an injected clock; budgets live behind
the ``Store`` interface (``store/``).
"""

from extproc.admission.controller import Admission
from extproc.admission.lease import Lease
from extproc.admission.errors import AdmissionError, InvalidDemandError, UnknownPoolError
from extproc.admission.store.base import Store, StoreError
from extproc.admission.store.memory import MemoryStore
from extproc.admission.types import (Demand, Outcome, PoolSignals, PoolSnapshot, RateInfo, Reason,
                                     Rejection)

__all__ = ["Admission", "AdmissionError", "Demand", "InvalidDemandError", "Lease", "MemoryStore",
           "Outcome", "PoolSignals", "PoolSnapshot", "RateInfo", "Reason", "Rejection", "Store",
           "StoreError", "UnknownPoolError"]
