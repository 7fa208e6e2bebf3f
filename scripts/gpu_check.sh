#!/usr/bin/env bash
# Every test tier that runs on a GPU machine (the CPU tests and the tests marked `gpu`), in one
# command, ending with one summary line. Run from a checkout after
#   python3 -m pip install --no-deps --no-build-isolation -e .
# Extra arguments go to pytest (e.g. -k attention). The log is written to $OUT (or /tmp) and lists the
# 25 slowest tests (what to look at first when the suite's device time is to be cut).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/gpu_check.log"
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
# The packages every process imports, and what the import costs there (ml-dtypes 0.7.0 alone took ~0.55 s).
python3 -c 'import time; t = time.perf_counter(); import tileinfer; t = time.perf_counter() - t
import numpy, ml_dtypes, tokenizers
print(f"gpu_check imports: numpy {numpy.__version__}, ml_dtypes {ml_dtypes.__version__}, tokenizers "
      f"{tokenizers.__version__}; import tileinfer {t:.2f} s")'
python3 -m pytest tests -q -rfEs -p no:cacheprovider --durations=25 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# pytest's last line of counts ("3 failed, 1312 passed, ... in 372.10s"); a second -q (-qq) leaves it out.
counts=$(grep -E '^(=+ )?([0-9]+ (passed|failed|skipped|deselected|errors?)|no tests ran)' "$log" | tail -n 1)
echo "gpu_check summary (${gpu:-no GPU found}): ${counts:-no line of counts in the log (was -q given again?)}"
exit "$rc"
