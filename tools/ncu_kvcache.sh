#!/usr/bin/env bash
# ncu metrics of every kernel of the decode calls of tools/profile_kvcache.py (contiguous, paged, append), in launch
# order: duration, grid, registers, achieved occupancy, DRAM throughput and the top stall reasons, so a paged or
# appending call's extra microseconds read as "which kernel, and waiting on what". Needs ncu (GPU machine).
# Usage: tools/ncu_kvcache.sh BATCH KV_LEN [--calls kvcache,paged256,...]
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # an in-place build of the tree imports (tools/ncu_compare.sh)
METRICS="gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum"
for r in long_scoreboard barrier wait short_scoreboard no_instruction; do
  METRICS+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
ncu --clock-control none --profile-from-start off --metrics "$METRICS" --csv \
  --page raw python3 tools/profile_kvcache.py "$@" > /tmp/ncu_kvcache.csv 2> /tmp/ncu_kvcache.err
python3 - <<'PY'
import csv
rows = list(csv.reader(l for l in open("/tmp/ncu_kvcache.csv") if l.startswith('"')))
if not rows:
    print(open("/tmp/ncu_kvcache.err").read()[-2000:])
    raise SystemExit(1)
head, units, data = rows[0], rows[1], rows[2:]
short = {"gpu__time_duration.sum": "time", "launch__grid_size": "grid", "launch__block_size": "block",
         "launch__registers_per_thread": "regs", "sm__warps_active.avg.pct_of_peak_sustained_active": "occ%",
         "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%", "smsp__inst_executed.sum": "inst"}
cols = [c for c in head if c in short or "stalled" in c]
name_col = head.index("Kernel Name")
nvtx = [i for i, c in enumerate(head) if c.startswith("NVTX")]
print("call | kernel | " + " | ".join((short[c] if c in short else c.split("stalled_")[1].split("_per")[0]) for c in cols))
for r in data:
    call = next((r[i] for i in nvtx if r[i]), "")
    values = [r[head.index(c)] + (" " + units[head.index(c)] if c == "gpu__time_duration.sum" else "") for c in cols]
    print(f"{call[:30]} | {r[name_col][:60]} | " + " | ".join(values))
PY
