"""Summary of the flash_attn_with_kvcache rounds of a tools/ab_bench.sh run (AB_KVCACHE=1: OUT/kv<round>_<variant>.json
from benchmarks/bench_kvcache.py --graph): per call and decode shape, each variant's best and median microseconds
replayed from a CUDA graph over the rounds, and its best as a ratio to the first variant's best.
Usage: python3 tools/ab_kvcache_summary.py OUT VARIANT [VARIANT ...]"""

import collections
import json
import statistics
import sys
from pathlib import Path

US_PER_MS = 1e3


def main() -> None:
    out, variants = Path(sys.argv[1]), sys.argv[2:]
    times: dict[tuple, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(out.glob("kv[0-9]*_*.json")):
        variant = path.stem.split("_", 1)[1]
        for row in json.loads(path.read_text())["rows"]:
            if row.get("mode") == "graph" and row.get("ms") is not None:
                times[(row["impl"], f"{row['batch']}x{row['kv_len']}")][variant].append(row["ms"] * US_PER_MS)
    print(" | ".join(["call", "batch x keys"] + [f"{v} best/med us (x {variants[0]})" for v in variants]))
    for key in sorted(times):
        cell = times[key]
        first = min(cell[variants[0]]) if cell.get(variants[0]) else float("nan")
        parts = list(key)
        for v in variants:
            got = cell.get(v, [])
            parts.append(f"{min(got):.1f}/{statistics.median(got):.1f} ({first / min(got):.2f})" if got else "-")
        print(" | ".join(parts))


if __name__ == "__main__":
    main()
