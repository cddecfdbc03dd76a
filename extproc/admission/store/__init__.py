"""store: where admission budgets live (in memory, or shared through Redis), behind one interface."""

from extproc.admission.store.base import (POOL_BUCKET, Budget, BucketSpec, Grant, Plan, PoolLimits, PoolUsage,
                                          Refusal, Store, StoreError, SyncStore)

__all__ = ["POOL_BUCKET", "Budget", "BucketSpec", "Grant", "Plan", "PoolLimits", "PoolUsage", "Refusal",
           "Store", "StoreError", "SyncStore"]
