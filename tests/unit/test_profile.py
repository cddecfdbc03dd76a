"""Unit tests of the Envoy files' profiles (extproc.request.profile): the module doc's table is
the rows, every file's routes carry the ``release`` of its row, and the mode each row names is
what a request admitted through that file takes."""

from __future__ import annotations

import asyncio

import pytest
from pathlib import Path

import yaml
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc import envoyconf
from extproc.configparse import load_config
from kvgate_testkit.stream import Stream
from extproc.gate import METADATA_NAMESPACE
from extproc.request import profile
from extproc.request.profile import PROFILES, ReleaseMode, Seen
from tests.unit.test_exchange import Rig, body_msg, chat, route_metadata
from tests.unit.test_exchange_attributes import attrs

ROOT = Path(__file__).resolve().parents[2]


def _doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (profile.__doc__ or "").splitlines():
        words = line.split()
        if words and words[0] in PROFILES:
            rows[words[0]] = words[1:]
    return rows


def test_the_module_doc_table_is_the_rows() -> None:
    yes = {"yes": True, "no": False}
    rows = _doc_rows()
    assert set(rows) == set(PROFILES)
    for name, row in PROFILES.items():
        cols = rows[name]
        assert yes[cols[0]] is row.headers_sent and yes[cols[1]] is row.duplex, name
        assert cols[2] == row.response.value, name
        assert cols[-3:] == ["yes" if row.periodic else "no", "yes" if row.picks else "no",
                             row.mode.name], name
        if row.response is not Seen.LOG:
            assert yes[cols[3]] is row.cause_from_log, name


def test_the_modes_are_the_envoy_writers_modes() -> None:
    assert envoyconf.MODES == tuple(PROFILES)
    assert {p.mode for p in PROFILES.values()} == set(ReleaseMode) - {ReleaseMode.OBSERVED}


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_route_of_a_written_file_carries_its_rows_release(name: str) -> None:
    row = PROFILES[name]
    config = load_config(ROOT / "deploy" / ("local" if row.picks else "") / "kvgate.yaml")
    releases = set()
    for route in envoyconf.envoy_filter(config, name)["virtual_host"]["routes"]:
        per_filter = route.get("typed_per_filter_config", {}).get("envoy.filters.http.set_metadata")
        if per_filter is not None:
            for entry in per_filter["metadata"]:
                assert entry["metadata_namespace"] == METADATA_NAMESPACE
                releases.add(entry["value"].get("release"))
    assert releases == {row.release.value if row.release else None}
    shipped = yaml.safe_load((ROOT / "deploy" / row.file).read_text())
    assert shipped["static_resources"]["listeners"]  # the row names a shipped file


def _protocol(row: profile.Profile) -> pb.ProtocolConfiguration:
    body = pm.ProcessingMode.FULL_DUPLEX_STREAMED if row.duplex else pm.ProcessingMode.BUFFERED
    response = (pm.ProcessingMode.NONE if row.response is not Seen.STREAM
                else pm.ProcessingMode.FULL_DUPLEX_STREAMED if row.duplex else pm.ProcessingMode.STREAMED)
    return pb.ProtocolConfiguration(request_body_mode=body, response_body_mode=response)


@pytest.mark.parametrize("name", [n for n, p in PROFILES.items() if not p.picks])
def test_a_request_through_each_file_takes_its_rows_mode_at_admission(name: str) -> None:
    row = PROFILES[name]
    ex = Stream(Rig().gate)
    meta = route_metadata(pool="default", **({"release": row.release.value} if row.release else {}))
    asyncio.run(ex.request_body(body_msg(chat(max_tokens=20)), None, attrs(), meta, _protocol(row)))
    assert ex.ending.mode is row.mode
