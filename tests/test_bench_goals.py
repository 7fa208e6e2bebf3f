"""scripts/bench_goals.py's table (the measuring needs a GPU; the table does not)."""
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tileinfer.cuda.compiler import COMPILE_LOG
from tileinfer.cuda.module import LOAD_LOG
from tileinfer.runner.gpu import RUNNER_LOG

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_goals.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_goals", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(table: str, case_start: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {case_start}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_every_goal_gets_a_row_and_unmeasured_ones_say_so():
    g = load()
    table = g.goals_table({})
    assert len(table.splitlines()) == 2 + len(g.GOALS)
    assert row(table, "qwen3-8b decode")[4] == "not measured"


def test_met_and_missed_goals():
    g = load()
    table = g.goals_table({
        "0.6b_b1": dict(measured=1263.5, peer=493.0, roofline=3418),
        "8b_b1": dict(measured=230.0),
        "4b_prefill": dict(measured=0.712, extra="562 TFLOP/s"),
    })
    assert row(table, "qwen3-0.6b decode, batch 1") == [
        "qwen3-0.6b decode, batch 1, 512 positions", "493.0", "3,418", ">= 2,000 tok/s", "1,264", "no"]
    assert row(table, "qwen3-8b decode")[-1] == "yes"
    assert row(table, "qwen3-4b prefill")[4:] == ["71.2% (562 TFLOP/s)", "yes"]


def test_startup_needs_zero_recompiles_as_well_as_time():
    g = load()
    fast_but_compiled = g.goals_table({"startup": dict(measured=0.8, compiled=3)})
    assert row(fast_but_compiled, "start-up")[4:] == ["0.80 s, 3 compiled", "no"]
    warm = g.goals_table({"startup": dict(measured=0.8, compiled=0)})
    assert row(warm, "start-up")[-1] == "yes"
    slow = g.goals_table({"startup": dict(measured=1.2, compiled=0)})
    assert row(slow, "start-up")[-1] == "no"


def test_measure_wires_every_case_from_the_bench_functions(monkeypatch):
    # bench.single / bench.engine replaced by fakes with the keys the real ones return (scripts/bench.py),
    # so the glue is checked without a GPU: every goal ends up measured, INT8 borrows the BF16 peer.
    import tileinfer.model.synthetic as synthetic

    calls = []

    def prof(kernel):
        return [dict(kernel=kernel, launches=36, us=100.0, GB_s=3000.0, TFLOP_s=None),
                dict(kernel="attention_decode", launches=36, us=50.0, GB_s=None, TFLOP_s=None)]

    def single(args, name, cfg, path, kv="bf16", peer=True):
        calls.append((name, args.context, kv, args.prefill, bool(peer and args.peer)))
        prefill = [dict(matmul_fraction=0.4, TFLOP_s=316.0, TFLOP_s_runs=[330.0, 316.0, 310.0],
                        profile=prof("gemm_tma_e2") if args.profile else None)] \
            if args.prefill else []
        ablation = dict(step_ms=2.9, groups=[dict(group=f"QKV {name} {args.context} {kv}", launches=36, us=480.0,
                                                  bytes=1.1e9, bound_us=263.0, GB_s=2370.0)])
        return dict(decode_tok_s=100.0 + len(calls), roofline_tok_s=500.0, prefill=prefill,
                    peer=dict(decode_tok_s_per_seq=90.0) if peer and args.peer else None,
                    profile=prof(f"gemv {name} {args.context} {kv}") if args.profile else None,
                    ablation=ablation if args.ablate else None)

    def engine(args, name, path):
        calls.append((name, "engine", args.batches, args.offline))
        return dict(batch_decode=[dict(batch=64, context=512, new=128, decode_tok_s=26000.0,
                                       peer=dict(decode_tok_s_total=21000.0),
                                       profile=prof("gemm_swap b64") if args.profile else None,
                                       ablation=dict(step_ms=2.4, groups=[dict(
                                           group="matrix products b64", launches=113, us=900.0, bytes=1.19e9,
                                           bound_us=277.0, GB_s=1322.0)]) if args.ablate else None)],
                    offline=dict(output_tok_s=21000.0, decode_steps=10, decode_positions=1000,
                                 typical_step=dict(batch=144, context=930, ablation=None)),
                    startup=dict(total=1.2, kernels_compiled=0, capture=0.1))

    spec = importlib.util.spec_from_file_location("bench_real", SCRIPT.parent / "bench.py")
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)  # its table renderer needs no GPU
    fake = types.SimpleNamespace(single=single, engine=engine, ROOFLINE_BYTES_PER_S=4.3e12,
                                 weight_bytes=lambda cfg: 1.2e9, kv_bytes=lambda cfg, n, kv="bf16": n * 114688,
                                 parser=real.parser, render_profile=real.render_profile,
                                 render_ablation=real.render_ablation,
                                 prefill_runs=real.prefill_runs)
    monkeypatch.setitem(sys.modules, "bench", fake)
    monkeypatch.setattr(synthetic, "cached_checkpoint", lambda name: f"/ckpt/{name}")
    g = load()
    monkeypatch.setattr(g, "cold_start", lambda model, timeout: dict(measured=6.0, compiled=17, warm=2.0,
                                                                      warm_compiled=0))
    args = types.SimpleNamespace(peer="peer.py", peer_timeout=10, profile=True, only=None, cold_model=None)
    values = g.measure(args)
    assert sorted(values) == sorted(key for key, *_ in g.GOALS)
    assert values["4b_32k_int8"]["peer"] == values["4b_32k_bf16"]["peer"] == 90.0
    assert ("qwen3-4b", 32768, "int8", "", False) in calls and ("qwen3-4b", 512, "bf16", "4096", True) in calls
    assert values["4b_prefill"]["measured"] == 0.4
    assert values["4b_prefill"]["extra"] == "316 TFLOP/s; prompts back to back: 330, 316, 310"
    assert "not measured" not in g.goals_table(values)
    # --profile: the single-sequence cases carry their profiles, listed under the table in GOALS order
    md = g.profiles_md(values)
    assert md.index("gemv qwen3-0.6b 512 bf16") < md.index("gemv qwen3-8b 512 bf16") < md.index("gemm_tma_e2")
    assert "gemv qwen3-4b 32768 int8" in md and "| attention_decode | 36 | 50.0 | 33.3% | - | - |" in md
    # ... the batch-64 step's profile, and each batch-1 case's in-graph cost per kernel group
    assert md.index("gemv qwen3-4b 32768 int8") < md.index("gemm_swap b64") < md.index("gemm_tma_e2")
    assert "| QKV qwen3-8b 512 bf16 | 36 | 480.0 | 13.33 | 263.0 | 2370 |" in md
    assert md.index("gemm_swap b64") < md.index("matrix products b64") < md.index("gemm_tma_e2")
    assert g.profiles_md({}) == ""
    # ... and each unmet decode goal's gap, from those ablations (the fakes' rates miss every goal)
    gaps = g.gaps_md(values)
    assert gaps.index("qwen3-0.6b decode, batch 1") < gaps.index("qwen3-0.6b decode, batch 64")
    assert values["0.6b_b64"]["cache_bytes"] == 64 * (512 + 64) * 114688
    assert values["0.6b_offline"]["run"]["decode_bytes"] == 10 * 1.2e9 + 1000 * 114688
    assert values["0.6b_offline"]["run"]["typical_step"]["cache_bytes"] == 144 * 930 * 114688


def test_gaps_name_the_groups_over_their_bytes_largest_first():
    g = load()
    ablation = dict(step_ms=2.600, groups=[
        dict(group="attention: attn_input, attention, combine", launches=108, us=400.0, bytes=0),
        dict(group="QKV GEMV, RMSNorm fused", launches=36, us=450.0, bytes=1.1e9),        # 256 us at 4.3 TB/s
        dict(group="gate/up GEMV, RMSNorm fused", launches=36, us=1000.0, bytes=3.6e9)])  # 837 us
    values = {"4b_b1": dict(measured=400.0, ablation=ablation, cache_bytes=0.4e9),   # the cache: 93 us
              "8b_b1": dict(measured=240.0, ablation=ablation)}                      # met: no gap
    md = g.gaps_md(values)
    assert "qwen3-8b" not in md
    assert "a step of 2500 us (GPU, without sampling: 2600 us); the goal (>= 450 tok/s) allows 2222 us: 278 us short" in md
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| group")]
    # excess over the bytes' time: other 750 (2600 - 1850), attention 307, QKV 194, gate/up 163
    assert [line.split("|")[1].strip() for line in lines] == [
        "other kernels (the step less the groups)", "attention: attn_input, attention, combine",
        "QKV GEMV, RMSNorm fused", "gate/up GEMV, RMSNorm fused"]
    assert "| QKV GEMV, RMSNorm fused | 450 | 256 | 194 | 2.44 | 1.86 |" in md
    assert "| attention: attn_input, attention, combine | 400 | 93 | 307 | 1.00 | 3.30 |" in md
    assert g.gaps_md({"4b_b1": dict(measured=400.0)}) == ""  # not ablated: nothing to say


def test_the_offline_gap_splits_its_seconds_into_decode_prefill_and_the_rest():
    g = load()
    run = dict(output_tokens=150_000, seconds=6.0, output_tok_s=25_000.0, decode_steps=900, decode_rows=149_744,
               decode_seconds=4.0, prefill_steps=40, prefill_step_seconds=1.7, prefill_tokens=143_000,
               outside_step_seconds=0.3)
    md = g.gaps_md({"0.6b_offline": dict(measured=25_000.0, run=run)})
    assert "the goal allows 4.69 s: 1.31 s short" in md  # 150,000 tokens at 32,000 tok/s
    assert "| decode steps (one token a row) | 900 | 4.00 | 149,744 tokens, 166.4 rows a step on average, 37,436 tok/s |" in md
    assert "| steps with prompt chunks | 40 | 1.70 | 143,000 prompt tokens" in md
    assert "| outside the steps (generate's own work) | - | 0.30 | - |" in md
    md = g.gaps_md({"0.6b_offline": dict(measured=25_000.0, run={**run, "decode_bytes": 12.0e12})})
    assert "37,436 tok/s; they read 12,000 GB (weights each step, the cache each row): 3.00 TB/s, 1.30 short of 4.3 |" in md
    typical = dict(batch=144, context=930, cache_bytes=15.4e9, ablation=dict(step_ms=5.0, groups=[
        dict(group="attention: attn_input, attention, combine", us=4000.0, bytes=0),
        dict(group="matrix products (LM head included)", us=800.0, bytes=1.19e9)]))
    md = g.gaps_md({"0.6b_offline": dict(measured=25_000.0, run={**run, "typical_step": typical})})
    assert "A decode step like the run's average (144 rows at 930 positions, 5000 us of GPU time)" in md
    assert "| attention: attn_input, attention, combine | 4000 | 3581 | 419 | 3.85 | 0.45 |" in md
    assert "| other kernels (the step less the groups) | 200 | 0 | 200 | - | - |" in md
    assert g.gaps_md({"0.6b_offline": dict(measured=33_000.0, run={**run, "output_tok_s": 33_000.0})}) == ""
    assert g.gaps_md({"0.6b_offline": dict(measured=25_000.0)}) == ""  # an older run without the breakdown


def test_the_peer_prewarm_runs_the_cases_measure_runs(monkeypatch):
    # The same (model, batch, context, new) as the timed runs, or the warm caches would not be hit.
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # bench_goals takes the command from scripts/bench.py
    g = load()
    cmds = g.peer_commands(Path("peer.py"))
    assert [c[2:] for c in cmds] == [["qwen3-0.6b", "1", "512", "128"], ["qwen3-4b", "1", "512", "128"],
                                     ["qwen3-8b", "1", "512", "128"], ["apertus-8b", "1", "512", "128"],
                                     ["qwen3-4b", "1", "32768", "128"], ["qwen3-0.6b", "64", "512", "128"],
                                     ["qwen3-4b", "256", "512", "128"]]


def test_cold_start_runs_twice_over_one_cache_that_starts_empty(monkeypatch):
    g = load()
    runs = []

    def run(cmd, env, timeout):  # stands in for a `tileinfer generate` that compiles into its kernel cache
        kernels = Path(env["TILEINFER_CACHE"]) / "kernels"
        runs.append((cmd, env["TILEINFER_CACHE"], sorted(p.name for p in kernels.glob("*"))))
        if not runs[1:]:
            kernels.mkdir(parents=True)
            for name in ("rmsnorm", "gemm_tma-0", "gemm_tma-1"):
                (kernels / f"{name}.cubin").write_bytes(b"\x7fELF")
            compiled = COMPILE_LOG % (38, 1.1, 16, 9.5, 8.0, 1.25, 120.5, 3, 7.25, "gemv.cu (part 0)", 1.02)
            bar = "compiling kernels (once; then cached):  41%|####  | 12/29 [00:01<00:02, left: gemm_swap.cu][A"
            return 5.5, 6.0, (f"INFO ...\n1321 ms tileinfer.runner.gpu: {RUNNER_LOG % (2.5, 0.05)}\n"
                              f"3900 ms tileinfer.cuda.module: {LOAD_LOG % ('embedding.cu', 2.1)}\n"
                              f"{bar}4100 ms tileinfer.cuda.compiler: {compiled}\n"
                              f"{bar}4150 ms tileinfer.cuda.module: {LOAD_LOG % ('gemm_swap.cu (part 3)', 0.2)}\n")
        return 1.25, 1.5, ""

    out = g.cold_start(Path("/ckpt/demo"), 600, run=run)
    (cmd, root, found), (cmd2, root2, found2) = runs
    assert cmd == cmd2 and cmd[:3] == [sys.executable, "-c", g.LOGGED_MAIN] and cmd[3] == "generate"
    assert cmd[cmd.index("--max-new-tokens") + 1] == "1" and cmd[cmd.index("--model") + 1] == "/ckpt/demo"
    assert root == root2 and found == [] and len(found2) == 3, runs
    assert not Path(root).exists(), "the temporary kernel cache was left behind"
    phases = ("at 1,321 ms: device opened in 2.50 s, weights loaded in 0.05 s; 2 units loaded once their compiles "
              "ended, the last gemm_swap.cu (part 3) at 4,150 ms (its compiles ended at 4,100 ms: compiled 38 kernel units in 1.10 s on 16 cores: their processes took 9.5 s "
              "summed (CPU 8.0 s user, 1.2 s system; 120 thousand page faults, 3 from disk), NVRTC 7.2 s of it; "
              "the longest gemv.cu (part 0) (1.02 s))")
    assert out == dict(measured=5.5, compiled=3, warm=1.25, warm_compiled=0,
                       extra=f"whole command 6.00 s, warm 1.50 s; the first run's GPU runner {phases}")
    g.cold_start(None, 600, run=lambda cmd, env, timeout: runs.append(cmd) or (1.0, 1.0, ""))
    assert "--model" not in runs[-1], "without a checkpoint the demo model is used"

    row_cells = row(g.goals_table({"cold_start": out}), "`tileinfer generate`")
    assert row_cells[4:] == [f"5.50 s (3 compiles); warm cache 1.25 s, 0 compiled (whole command 6.00 s, warm 1.50 s; "
                             f"the first run's GPU runner {phases})", "yes"]
    recompiled = row(g.goals_table({"cold_start": {**out, "warm_compiled": 2}}), "`tileinfer generate`")
    assert recompiled[-1] == "no", recompiled
    slow = row(g.goals_table({"cold_start": {**out, "measured": 12.0}}), "`tileinfer generate`")
    assert slow[-1] == "no", slow


def test_the_logged_command_runs_tileinfer_with_its_arguments_and_logs_at_info():
    g = load()
    code = g.LOGGED_MAIN.replace("runpy.", "logging.getLogger('x').info('hi'); runpy.")
    out = subprocess.run([sys.executable, "-c", code, "generate", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--max-new-tokens" in out.stdout, out.stderr
    assert re.search(r"^\d+ ms x: hi$", out.stderr, re.M), out.stderr


def test_first_output_times_the_first_byte_and_the_exit():
    g = load()
    code = "import sys, time; time.sleep(0.3); print('x', flush=True); sys.stderr.write('.' * 100000); time.sleep(1)"
    first, total, err = g.first_output([sys.executable, "-c", code], {}, 60)
    assert 0.3 <= first and total - first >= 0.9 and err == "." * 100000, (first, total)
    with pytest.raises(RuntimeError, match="exited with status 3 after .* s:\nno GPU here"):
        g.first_output([sys.executable, "-c", "import sys; sys.stderr.write('no GPU here'); sys.exit(3)"], {}, 60)


def test_only_runs_the_cases_of_the_keys_given(monkeypatch):
    import tileinfer.model.synthetic as synthetic

    fake = types.SimpleNamespace(single=None, engine=None)  # a case that ran would fail on these
    monkeypatch.setitem(sys.modules, "bench", fake)
    monkeypatch.setattr(synthetic, "cached_checkpoint", lambda name: f"/ckpt/{name}")
    g = load()
    models = []
    monkeypatch.setattr(g, "cold_start", lambda model, timeout: models.append(model) or dict(measured=4.0))
    args = types.SimpleNamespace(peer=None, peer_timeout=10, profile=False, only=["cold_start"],
                                 cold_model=Path("/ckpt/x"))
    assert g.measure(args) == {"cold_start": dict(measured=4.0)} and models == [Path("/ckpt/x")]


def test_merge_writes_one_table_from_runs_of_different_cases(tmp_path, monkeypatch, capsys):
    # --only parts of one run, each a bench_goals.json of its own, make one table; a case in two parts is refused.
    g = load()
    first, second = tmp_path / "a", tmp_path / "b"
    g.write(first, {"runs": ["run A"], "0.6b_b1": dict(measured=1633.8, peer=461.1, roofline=3418)})
    g.write(second, {"runs": ["run B"], "4b_b256": dict(measured=26334.0, peer=23210.0, roofline=36954),
                     "startup": dict(measured=0.53, compiled=0)})
    out = tmp_path / "merged"
    monkeypatch.setattr(sys, "argv", ["bench_goals.py", "--merge", str(first / "bench_goals.json"),
                                      str(second / "bench_goals.json"), "--out", str(out)])
    g.main()
    table = (out / "bench_goals.md").read_text()
    assert table.startswith("Run: run A\nRun: run B\n\n| case |")  # each part's run, then the one table
    assert row(table, "qwen3-0.6b decode, batch 1")[1:5] == ["461.1", "3,418", ">= 2,000 tok/s", "1,634"]
    assert row(table, "qwen3-4b decode, batch 256")[4:] == ["26,334", "no"]
    assert row(table, "start-up")[-1] == "yes"
    assert row(table, "qwen3-8b decode")[4] == "not measured"
    assert "qwen3-4b decode, batch 256" in capsys.readouterr().out

    monkeypatch.setattr(sys, "argv", ["bench_goals.py", "--merge", str(first / "bench_goals.json"),
                                      str(first / "bench_goals.json")])
    with pytest.raises(SystemExit, match="0.6b_b1 is in both"):
        g.main()
    (tmp_path / "bad.json").write_text("[1, 2]")
    monkeypatch.setattr(sys, "argv", ["bench_goals.py", "--merge", str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match="not a bench_goals.json"):
        g.main()
    monkeypatch.setattr(sys, "argv", ["bench_goals.py", "--merge", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="cannot read"):
        g.main()
    monkeypatch.setattr(sys, "argv", ["bench_goals.py", "--merge", str(tmp_path / "bad.json"), "--only", "startup"])
    with pytest.raises(SystemExit) as refused:  # argparse's error (status 2): --merge measures nothing
        g.main()
    assert refused.value.code == 2


def test_bench_options_cover_every_attribute_bench_reads(monkeypatch):
    # bench_goals runs bench.py's functions over bench.parser()'s defaults; an option read but not defined there
    # would fail only on a GPU, case by case.
    import re
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench
    defined = set(vars(bench.parser().parse_args([])))
    read = set(re.findall(r"\bargs\.([a-z_]+)", (SCRIPT.parent / "bench.py").read_text()))
    assert read and read <= defined, sorted(read - defined)
