"""scripts/bench.py's results table (the measuring needs a GPU; the table does not)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench  # noqa: E402


def test_engine_rows_name_their_cache_and_count_its_bytes():
    # The same step time reads fewer cache bytes with INT8 (codes + a float32 scale per vector), so
    # its GB/s is lower; a row without "kv" (older results) is BF16.
    common = dict(batch=64, context=512, new=128, decode_tok_s=26000.0, ms_per_step=2.4)
    results = [dict(model="qwen3-0.6b", engine=dict(batch_decode=[dict(common, kv="int8"), dict(common)]))]
    lines = [line for line in bench.render(results, "H200").splitlines() if line.startswith("| qwen3-0.6b")]
    int8, bf16 = ([c.strip() for c in line.strip("|").split("|")] for line in lines)
    assert (int8[1], bf16[1]) == ("INT8", "BF16")
    assert float(int8[6]) < float(bf16[6])
    cfg = bench.preset("qwen3-0.6b")
    positions = 512 + 64
    assert bench.kv_bytes(cfg, positions, "int8") / bench.kv_bytes(cfg, positions) == (128 + 4) / 256
