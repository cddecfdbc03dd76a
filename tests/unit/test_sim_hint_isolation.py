"""kvgate must not read the simulator's output-length hint: a gateway cannot know when a model stops."""

from __future__ import annotations

from pathlib import Path

from sim.api import OUTPUT_TOKENS_HEADER

ROOT = Path(__file__).resolve().parents[2]


def test_no_kvgate_module_or_envoy_file_mentions_the_output_length_header():
    sources = [*sorted((ROOT / "extproc").rglob("*.py")), *sorted((ROOT / "deploy").rglob("*.yaml"))]
    assert len(sources) > 20                       # the walk found the package and the deploy files
    readers = [str(p.relative_to(ROOT)) for p in sources
               if OUTPUT_TOKENS_HEADER in p.read_text(errors="replace").lower()]
    assert readers == []
