"""The one definition of the Redis scripts' arguments: what Python packs is what Lua reads.

Each layout of ``redis_lua`` is packed with distinct values and read back by the Lua its
script uses (``lua_locals``, ``lua_each``), in a real Redis-protocol server: a field that
Python and Lua order differently, or read as the wrong kind, comes back changed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import redis as redis_sync
from hypothesis import given
from hypothesis import strategies as st

from extproc.admission.bucket import FIT_SLACK
from extproc.admission.shared_nodes import Candidate as C, NodeAsk
from extproc.admission.store import redis_lua as L
from extproc.admission.types import Budget
from kvgate_testkit.redis_server import RedisServer

# Every layout with a distinct sample value per field (text fields get text, the rest numbers,
# ``now`` an instant, None a missing number), the fields that expand into others, its group.
SAMPLES: list[tuple[Any, dict[str, Any], str | None]] = [
    (L.AdmitArg(1000.25, "r.1", 30.0, "gold", 700, L.pack(L.AdmitPool(6, 8000, None, 1.5, 6000.0, 100.0, 6000.0)),
                3000.0, 50.0, 3000.0, -1.0, 4400, None, 1, L.pack(L.Guarantee("gold", 2))),
     {"pool": L.AdmitPool}, "guarantees"),
    (L.SettleArg(None, "r.2", 512, 30.0, None, None, 3000.0, 50.0, 60.0), {}, None),
    (L.RefreshArg(1000.5, 30.0, 1, "replica-a", 7), {}, None),
    (L.RefreshLease("r.3", "gold", 700, "n1", 900, -640, 512, 200.5, 9000.25), {}, None),
    (L.HeartbeatArg(7.0, "replica-a", 12.5, "127.0.0.1:9464", 30.0), {}, None),
    (L.ReleaseArg(None, 30.0, "replica-b"), {}, None),
    (L.NodeArg(640, 0.15, 0.55, 100, 512, 200.5, 9000.25, 1.2815515655446004, 10_200, 1.5,
               L.pack(L.NodeCandidate("n0", 10000, 300, 40, 1000.75, 1, 32, 9984))), {}, "nodes"),
    (L.ChainLink("18446744073709551557", 9984), {}, None),
]


def expected(value: Any, expand: dict[str, Any], group: str | None) -> list[tuple[str, Any]]:
    """expected is the (name, value) Lua should read into locals, in the field order of
    ``value``'s layout (the group's words are walked by ``lua_each``, not read into locals)."""
    out: list[tuple[str, Any]] = []
    for name, v in zip(type(value)._fields, value):
        if name == group:
            continue
        if name in expand:
            out.extend(expected(expand[name](*(None if w == "-" else w for w in v.split())), {}, None))
        else:
            out.append((name, v))
    return out


def read_back(r: redis_sync.Redis, layout: Any, packed: str, expand: dict[str, Any],
              group: str | None) -> list[str]:
    """read_back runs the layout's generated Lua on ``packed`` and returns every local as a
    word: numbers as %.17g, nil as '-'."""
    names = [n for f in layout._fields if f != group
             for n in (expand[f]._fields if f in expand else (f,))]
    body = (L._CLOCK + "local a = args(ARGV[1])\n" + L.lua_locals(layout, "a", expand=expand, group=group)
            + "\nlocal out = {}\n"
            + "".join(f"out[{i}] = {n} == nil and '-' or (type({n}) == 'number' and fmt({n}) or {n})\n"
                      for i, n in enumerate(names, 1))
            + "return out")
    return [w.decode() for w in r.eval(body, 0, packed)]


@pytest.mark.redis
@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s[0]).__name__)
def test_lua_reads_every_field_that_python_packs(redis_server: RedisServer, sample) -> None:
    value, expand, group = sample
    r = redis_sync.Redis.from_url(redis_server.url)
    got = read_back(r, type(value), L.pack(value), expand, group)
    want = expected(value, expand, group)
    assert len(got) == len(want)
    for g, (name, w) in zip(got, want):
        if name == "now" and w is None:
            assert float(g) > 1e9  # Redis TIME: seconds since 1970
        elif w is None:
            assert g == "-"
        elif isinstance(w, str) and not _number(w):
            assert g == w
        else:
            assert float(g) == float(w)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@pytest.mark.redis
def test_lua_walks_the_repeated_words_in_python_order(redis_server: RedisServer) -> None:
    """The nodes of a NodeArg and the guarantees of an AdmitArg come back in order, by name."""
    r = redis_sync.Redis.from_url(redis_server.url)
    ask = NodeAsk((C("n0", 10000, 300, 0), C("n1", 2000, 0, 5), C("n2", 7, 6, 1)), 640, 0.15, 0.55)
    body = (L._CLOCK + "local q = args(ARGV[1])\n" + L.lua_locals(L.NodeArg, "q", group="nodes") + "\n"
            "local out = {}\n" + L.lua_each(L.NodeCandidate, "q", "nodes") + "\n"
            "  out[#out + 1] = name .. ':' .. cap .. ':' .. foreign\nend\nreturn out")
    assert [w.decode() for w in r.eval(body, 0, L.node_arg(ask))] == ["n0:10000:300", "n1:2000:0", "n2:7:6"]


@pytest.mark.redis
def test_the_scripts_constants_are_the_python_ones(redis_server: RedisServer) -> None:
    """FIT is bucket.FIT_SLACK and each B_<NAME> the Budget's value, in every pool script."""
    r = redis_sync.Redis.from_url(redis_server.url)
    names = [b.name for b in Budget]
    body = (L._PRELUDE + "return {fmt(FIT), " + ", ".join(f"B_{n}" for n in names) + "}")
    fit, *budgets = (w.decode() for w in r.eval(body, 0))
    assert float(fit) == FIT_SLACK
    assert budgets == [b.value for b in Budget]
    for script in (L.ADMIT, L.SETTLE, L.REFRESH):
        assert script.source.startswith(L._PRELUDE)


@given(st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**53, 2**53))
def test_a_number_word_round_trips_exactly(x: float) -> None:
    assert type(x)(L.word(x)) == x


@pytest.mark.parametrize("bad", [True, b"x", 1j, [1]])
def test_a_word_is_text_a_number_or_none(bad: object) -> None:
    assert L.word(None) == "-"
    with pytest.raises(TypeError):
        L.word(bad)


def test_a_command_takes_the_keys_of_its_own_layout() -> None:
    keys = L.PoolKeys("st", "lz", "lh", "done", "st", "st", "nk", "rb", "sn", "sr", "nm", "pk", "ps", "lk")
    cmd = L.SETTLE.command(keys, "arg")
    assert cmd[:3] == ("EVALSHA", L.SETTLE.sha, 14) and cmd[3:17] == tuple(keys) and cmd[17:] == ("arg",)
    with pytest.raises(TypeError, match="RefreshKeys"):
        L.REFRESH.command(keys)


def test_a_group_must_be_the_last_field() -> None:
    class Bad(NamedTuple):
        items: str
        after: int

    with pytest.raises(ValueError, match="last field"):
        L.lua_locals(Bad, "a", group="items")
