"""store: where admission budgets live (in memory, or shared through Redis), behind one interface."""

from extproc.admission.store.base import Store, StoreError, SyncStore

__all__ = ["Store", "StoreError", "SyncStore"]
