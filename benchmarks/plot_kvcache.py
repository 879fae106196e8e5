#!/usr/bin/env python3
# Turns a benchmarks/bench_kvcache.py JSON into a PNG: per decode shape, one bar of TB/s of K + V per call (the cache
# call plain, with an append, with append + rotary, over paged caches, flash_attn_func and the SDPA backends), each
# replayed from a CUDA graph (--mode eager for the eager timings). Needs matplotlib.
# Usage: benchmarks/plot_kvcache.py RESULTS.json OUT.png [--mode graph]
import argparse
import json
from pathlib import Path

FIGURE_INCHES = (11.0, 4.2)
DPI = 120
BAR_GROUP_WIDTH = 0.85
CALLS = ("func", "kvcache", "append", "append_rotary", "paged256", "paged16", "sdpa_cudnn", "sdpa_flash")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results")
    parser.add_argument("out")
    parser.add_argument("--mode", default="graph", choices=("graph", "eager"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.results).read_text())
    rows = [r for r in data["rows"] if r["mode"] == args.mode and r["tbps"] is not None and not r["error"]]
    shapes = list(dict.fromkeys((r["batch"], r["kv_len"]) for r in rows))
    calls = [c for c in CALLS if any(r["impl"] == c for r in rows)]
    width = BAR_GROUP_WIDTH / len(calls)
    fig, ax = plt.subplots(figsize=FIGURE_INCHES)
    for i, call in enumerate(calls):
        rate = {(r["batch"], r["kv_len"]): r["tbps"] for r in rows if r["impl"] == call}
        xs = [s + (i - (len(calls) - 1) / 2) * width for s in range(len(shapes))]
        ax.bar(xs, [rate.get(shape, 0.0) for shape in shapes], width, label=call)
    ax.set_xticks(range(len(shapes)), [f"{b} x {k // 1024}k" for b, k in shapes])
    ax.set_ylabel("TB/s of K + V read")
    env = data["environment"]
    ax.set_title(f"flash_attn_with_kvcache decode, {env['device_name']}, bf16, GQA 32/8, hd 128 "
                 f"({args.mode}, commit {env['commit'][:7]})")
    ax.legend(ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(args.out, dpi=DPI)


if __name__ == "__main__":
    main()
