"""`profile_hot_path --callgrind`'s report of attribute reads by name, from the lines
`callgrind_annotate --tree=caller` prints (as it printed them for a gateway under load), and its
choice of the dump files to count."""

from __future__ import annotations

from pathlib import Path

from tests.bench.profile_hot_path import dump_threads, lookups_in, summary_of

NATIVE = "/work/main/build/native/gateway/__native__native.c"
LIB = "python-build.1/Python-3.11.7/Objects/object.c"
TREE = [
    f"    1,000 ( 0.01%)  < {NATIVE}:CPyDef_other___f (9x) [/x.so]",
    f"    2,000 ( 0.10%)  *  {LIB}:PyObject_GenericGetAttr [/lib/libpython3.11.so.1.0]",
    "",
    f"   17,567,260 ( 1.12%)  < {NATIVE}:CPyDef_ratelimit___RateLimitFilter___decide (81,960x) "
    "[/work/main/gateway/_native__mypyc.cpython-311-x86_64-linux-gnu.so]",
    f"    4,453,745 ( 0.28%)  < {NATIVE}:CPyDef_core___request___route_matches (27,320x) [/x.so]",
    f"    6,711,068 ( 0.43%)  < {LIB}:_PyEval_EvalFrameDefault'2 (13,403x) [/lib/x.so]",
    f"    1,000,000 ( 0.10%)  < {NATIVE}:CPyDef_core___request___route_matches'2 (5,464x) [/x.so]",
    f"  128,960,286 ( 8.23%)  *  /tmp/{LIB}:PyObject_GetAttr",
    "",
    f"      100 ( 0.00%)  < {NATIVE}:CPyDef_never___counted (1,000,000x) [/x.so]",
    f"      100 ( 0.00%)  *  {LIB}:PyObject_GetAttr [/lib/libpython3.11.so.1.0]",
]


def test_the_callers_of_a_read_by_name_per_request() -> None:
    found = lookups_in(TREE, 5464)
    assert [fn for _, fn in found] == [
        "ratelimit___RateLimitFilter___decide",
        "core___request___route_matches",
        "_PyEval_EvalFrameDefault",
    ]
    assert [round(n, 2) for n, _ in found] == [15.0, 6.0, 2.45]


def test_no_such_block_gives_nothing() -> None:
    assert lookups_in(TREE[:3], 10) == []


def test_the_newest_dump_of_each_thread_and_its_total(tmp_path: Path) -> None:
    """`--separate-threads=yes` writes FILE.N-TT (dump N, thread TT) and FILE-TT at exit; the
    newest N is the dump after the zeroing."""
    dump = tmp_path / "out"
    for name, total in [("out.1-01", 5), ("out.1-02", 6), ("out.2-01", 700), ("out.2-02", 30),
                        ("out-01", 9), ("out.x-01", 1)]:  # fmt: skip
        (tmp_path / name).write_text(f"events: Ir\nsummary: {total}\n")
    threads = dump_threads(dump)
    assert sorted(threads) == ["01", "02"]
    assert [summary_of(threads[t]) for t in ("01", "02")] == [700, 30]
    assert dump_threads(tmp_path / "none") == {}
