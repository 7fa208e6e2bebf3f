"""scripts/bench_ingest.py's host side: its probe compiles (NVRTC needs no GPU), its plan and its table."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_ingest  # noqa: E402
from tileinfer.cuda.module import entry_points  # noqa: E402


def test_the_probe_compiles_for_hopper():
    assert sorted(entry_points(bench_ingest.compile_probe("sm_90a"))) == ["ingest", "ingest_mc"]


def test_the_plan_leaves_out_rings_too_large_and_sms_the_gpu_lacks():
    plan = bench_ingest.plan(["tensor", "bulk"], ["l2"], [1, 132, 200], [96, 224], [1, 6, 8], max_sms=132)
    assert {c["sms"] for c in plan} == {1, 132}
    assert all(c["stages"] * c["box_rows"] * 128 <= bench_ingest.MAX_RING for c in plan)
    one = dict(depth=1, copies=1, issuer="one")
    assert dict(path="bulk", data="l2", sms=132, box_rows=96, stages=8, **one) in plan      # 96 KB
    assert dict(path="bulk", data="l2", sms=132, box_rows=224, stages=8, **one) not in plan  # 224 KB: too large
    assert len(plan) == 2 * 2 * (3 + 2)


def test_slices_are_the_tensor_paths_and_lanes_issue_only_bulk_copies():
    plan = bench_ingest.plan(["tensor", "bulk", "cp_async"], ["l2"], [132], [64], [2], 132, depths=[1, 2],
                             copies=[1, 4], issuers=["one", "lanes"])
    assert {(c["path"], c["depth"]) for c in plan} == {("tensor", 1), ("tensor", 2), ("bulk", 1), ("cp_async", 1)}
    assert {c["issuer"] for c in plan if c["path"] == "cp_async"} == {"one"}
    assert len(plan) == 2 * 2 * 2 + 2 * 2 + 2   # tensor: depth x copies x issuer; bulk: copies x issuer


def test_the_table_gives_each_sms_share_and_the_bytes_in_flight():
    rows = [dict(path="tensor", data="hbm", sms=132, box_rows=224, depth=1, copies=1, issuer="one", stages=6,
                 us=2000.0, GB_s=3300.0),
            dict(path="tensor", data="l2", sms=1, box_rows=64, depth=2, copies=3, issuer="lanes", stages=4,
                 us=10.0, GB_s=160.0)]
    first, second = bench_ingest.render(rows, "H200").splitlines()[-2:]
    assert [c.strip() for c in first.strip("|").split("|")] == ["tensor", "hbm", "132", "28", "1", "one", "6", "168",
                                                                "3,300", "25.0", "1147", "2000.0"]
    assert [c.strip() for c in second.strip("|").split("|")] == ["tensor", "l2", "1", "16 (2 slices)", "3", "lanes",
                                                                 "4", "192", "160", "160.0", "102", "10.0"]


def test_unknown_paths_are_refused():
    with pytest.raises(SystemExit):
        bench_ingest.parser().parse_args(["--paths", "tensor,dma"])
    assert bench_ingest.parser().parse_args(["--paths", "bulk"]).paths == ["bulk"]


def test_multicast_pairs_need_an_even_number_of_copies_and_sms():
    plan = bench_ingest.plan(["tensor_mc"], ["l2"], [1, 132], [64], [4], 132, copies=[1, 2, 3, 4],
                             issuers=["one", "lanes"])
    assert [(c["sms"], c["copies"], c["issuer"]) for c in plan] == [(132, 2, "one"), (132, 4, "one")]
