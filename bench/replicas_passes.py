"""replicas_passes: the replicas benchmark's passes over its rows, for this tree and, with
``--baseline REF``, for kvgate as it is at another git revision in the same run.

With a baseline every row of a pass is run by both trees back to back, in the other order
than the row before (this tree first, then the baseline first), so that both meet the same
machine at the same hour: on 2 shared cores the goodput of one revision moves by several
hundredths between passes of one hour, more than most changes it is asked to weigh. Only
kvgate comes from the baseline (``kvgate_testkit.revision``); the nodes, the clients and
the report are this tree's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bench.trace_report import summarize
from kvgate_testkit.procs import print_tails

if TYPE_CHECKING:
    from bench.bench_replicas import Row, RowRun
    from bench.trace_workload import Scenario

THIS = "this tree"

RunRow = Callable[["Row", Path, str, "Path | None"], "RowRun"]
"""RunRow runs one row in a work folder under a label, with kvgate's ``extproc`` from the
given folder (None: this tree's)."""


def run_passes(rows: Sequence[Row], repeat: int, tmp: Path, sc: Scenario, baseline: tuple[str, Path] | None,
               run_row: RunRow) -> dict[str, list[list[RowRun]]]:
    """run_passes runs ``rows`` of scenario ``sc`` ``repeat`` times in turn, each by this tree
    and by the ``baseline`` (its name and the folder its ``extproc`` comes from; None: none);
    returns each tree's passes, a pass being its runs of the rows in order."""
    trees: list[tuple[str, Path | None]] = [(THIS, None)] + ([baseline] if baseline else [])
    out: dict[str, list[list[RowRun]]] = {name: [] for name, _ in trees}
    turn = 0
    for k in range(repeat):
        for runs in out.values():
            runs.append([])
        for i, row in enumerate(rows):
            order = list(enumerate(trees))
            if turn % 2:
                order.reverse()
            turn += 1
            for j, (name, source) in order:
                tag = f" ({name})" if baseline else ""
                label = f"{i + 1}/{len(rows)} {row.key}" + (f", run {k + 1}/{repeat}" if repeat > 1 else "") + tag
                print(f"- {row.key}: {row.replicas} replica(s), {row.fault.title}{tag}", flush=True)
                workdir = tmp / f"{row.key}-{k}-{j}"
                rr = run_row(row, workdir, label, source)
                print(f"  [{label}] {progress(rr, sc)}", flush=True)
                if rr.run.error:
                    print_tails(workdir)
                out[name][-1].append(rr)
    return out


def progress(rr: RowRun, sc: Scenario) -> str:
    """progress is a finished row's lines of progress: wall time, preemptions, goodput and
    each replica's decisions."""
    lines = [f"{rr.run.wall_s:.0f} s: preemptions {rr.run.preemptions}, goodput "
             f"{summarize(rr.run, sc.background).goodput:,.0f} tok/s" + (f"  ERROR: {rr.run.error}" if rr.run.error else "")]
    lines += [f"  replica {n + 1} decisions: " + ", ".join(f"{d} {c}" for d, c in sorted(seen.items()))
              for n, seen in enumerate(rr.decisions)]
    return "\n".join(lines)
