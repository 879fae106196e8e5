#!/usr/bin/env python3
"""The README's "portable path beyond the table" rows from bench_attention.py --sweep JSON files, one per column
group (1k / 4k / 16k and the two shared-memory limits at 4k): plain rows ours / FA2 with the ratio (the faster of
sdpa_flash and fa2_varlen, FA2's kernels through torch's two entry points), feature rows ours against the same call
without the feature, window and document rows also against fa2_varlen where the file has it.
Usage: python3 tools/sweep_table.py 1k=A.json 4k=B.json 16k=C.json "A100 limit 4k"=D.json "sm86 limit 4k"=E.json"""

import json
import sys

OURS, FA2, FA2_VARLEN = "flash_attn_portable", "sdpa_flash", "fa2_varlen"
DIRECTIONS = ("fwd", "bwd")


def load(path: str) -> dict:
    rates = {}
    for row in json.load(open(path))["rows"]:
        if row.get("tflops") is None or row.get("error"):
            continue
        key = (row["headdim"], row["causal"], row["nheads"], row["nheads_k"], row["feature"], row["doc_len"])
        rates[(row["impl"], key, row["direction"])] = row["tflops"]
    return rates


def feature_name(feature: str, doc_len: int) -> str:
    return f"documents of {doc_len}" if feature == "varlen" else ("—" if feature == "none" else feature)


def cell(rates: dict, key: tuple, direction: str) -> str:
    ours = rates.get((OURS, key, direction))
    if ours is None:
        return "—"
    feature = key[4]
    if feature == "none":  # FA2's faster entry point, its varlen one marked v
        # GQA runs the varlen entry on repeated K / V (torch 2.11's varlen_attn has no GQA), whose copy sits in the
        # forward row: GQA forwards compare with sdpa_flash (FA2's own GQA) only.
        gqa_forward = key[2] != key[3] and direction == "fwd"
        varlen_peer = None if gqa_forward else rates.get((FA2_VARLEN, key, direction))
        peers = [(rate, mark) for rate, mark in ((rates.get((FA2, key, direction)), ""), (varlen_peer, "v")) if rate]
        if not peers:
            return f"{ours:.0f}"
        peer, mark = max(peers)
        return f"{ours:.0f} / {peer:.0f}{mark} ({ours / peer:.2f})"
    text = f"{ours:.0f}"
    varlen_peer = rates.get((FA2_VARLEN, key, direction))
    if varlen_peer:
        text += f" / {varlen_peer:.0f} ({ours / varlen_peer:.2f})"
    plain = rates.get((OURS, key[:4] + ("none", 0), direction))
    if plain and feature != "varlen":
        text += f", {100 * (ours / plain - 1):+.0f} %".replace("-", "−")
    return text


def main(argv: list[str]) -> int:
    if not argv or any("=" not in arg for arg in argv):
        print(__doc__, file=sys.stderr)
        return 2
    columns = [(name, load(path)) for name, path in (arg.split("=", 1) for arg in argv)]
    keys = []
    for _, rates in columns:
        for impl, key, _ in rates:
            if impl == OURS and key not in keys:
                keys.append(key)
    header = ["hd", "causal", "heads", "feature"] + [f"{name} {d}" for name, _ in columns for d in DIRECTIONS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in keys:
        hd, causal, heads, heads_k, feature, doc_len = key
        cells = [str(hd), "yes" if causal else "no", f"{heads}/{heads_k}", feature_name(feature, doc_len)]
        cells += [cell(rates, key, d) for _, rates in columns for d in DIRECTIONS]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
