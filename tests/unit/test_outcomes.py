"""Unit tests of the outcome enums the request and access-log metrics are labelled by."""

from __future__ import annotations

from extproc.admission.types import Reason
from extproc.metrics import ACCESS_LOG_RESULTS, OUTCOMES
from extproc.outcomes import REJECTED_BY, LogResult, RequestOutcome


def test_every_budget_that_refuses_has_its_own_outcome() -> None:
    assert set(REJECTED_BY) == set(Reason)
    assert len(set(REJECTED_BY.values())) == len(Reason)
    for reason, outcome in REJECTED_BY.items():
        assert outcome.reason == reason.value  # the x-kvgate-reason header names the budget


def test_metric_label_values_are_the_enum_values_in_order() -> None:
    assert OUTCOMES == tuple(o.value for o in RequestOutcome)
    assert OUTCOMES[:2] == ("admitted", "passed") and all(o.startswith("rejected_") for o in OUTCOMES[2:])
    assert ACCESS_LOG_RESULTS == ("released", "cause", "complete", "no_lease", "unmatched", "progress",
                                  "progress_invalid", "periodic", "malformed")
    assert tuple(LogResult) == ACCESS_LOG_RESULTS
