"""Summary of a tools/ab_bench.sh run: per shape and direction, each variant's best and median TFLOP/s over the
rounds (OUT/r<round>_<variant>_hk<n>[_s<set>].json; a row's feature and document length are part of its shape, so
AB_ARG_SETS runs such as --feature softcap have lines of their own), the peer's best (FA2, sdpa_flash, unless --peer
names another), and each variant's best as a ratio to the best of the peer timed in that variant's own processes
(none where the peer refuses the feature; decode rows, AB_DECODE=1: TB/s, keyed by batch x KV length).
Usage: python3 tools/ab_summary.py [--peer IMPL] OUT VARIANT [VARIANT ...]"""

import collections
import json
import re
import statistics
import sys
from pathlib import Path


def main() -> None:
    args = sys.argv[1:]
    peer = "sdpa_flash"
    if args[:1] == ["--peer"]:
        peer, args = args[1], args[2:]
    out, variants = Path(args[0]), args[1:]
    speeds: dict[tuple, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(out.glob("r*_*.json")):
        variant = re.sub(r"_hk\d+(_s\d+)?$", "", path.stem.split("_", 1)[1]).removesuffix("_decode")
        for row in json.loads(path.read_text())["rows"]:
            decode = row.get("seqlen_q") == 1
            rate = row.get("tbps") if decode else row.get("tflops")
            if rate is None or row["impl"] == "copy_ceiling":
                continue
            seqlen = f"{row['batch']}x{row['seqlen']}" if decode else row["seqlen"]
            heads = f"{row['nheads']}/{row['nheads_k']}" if "nheads_k" in row else "-"
            feature = row.get("feature", "none")
            if row.get("doc_len"):
                feature = f"docs of {row['doc_len']}"
            key = ("decode" if decode else row["direction"], row["headdim"], heads, feature, row["causal"], seqlen)
            if row["impl"] == peer:
                speeds[key]["peer"].append(rate)
                speeds[key][f"peer@{variant}"].append(rate)
            else:
                speeds[key][variant].append(rate)
    header = ["dir", "hd", "heads", "feature", "causal", "seqlen", f"{peer} best"]
    header += [f"{v} best/med (x {peer})" for v in variants]
    print(" | ".join(header))
    for key in sorted(speeds, key=str):
        cell = speeds[key]
        fa2 = max(cell["peer"]) if cell["peer"] else float("nan")
        peer_cell = "-" if fa2 != fa2 else f"{fa2:.2f}" if key[0] == "decode" else f"{fa2:.0f}"
        parts = [str(k) for k in key] + [peer_cell]
        for v in variants:
            got = cell.get(v, [])
            digits = 2 if key[0] == "decode" else 0
            own = max(cell[f"peer@{v}"]) if cell.get(f"peer@{v}") else fa2
            if not got:
                parts.append("-")
                continue
            ratio = f" ({max(got) / own:.2f})" if own == own else ""  # NaN: no peer row
            parts.append(f"{max(got):.{digits}f}/{statistics.median(got):.{digits}f}{ratio}")
        print(" | ".join(parts))


if __name__ == "__main__":
    main()
