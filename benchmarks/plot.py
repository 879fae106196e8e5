#!/usr/bin/env python3
# Turns results JSON written by bench_attention.py into a PNG (TFLOP/s vs seqlen per implementation, one
# panel per dtype/headdim/causal/direction; decode as bars of TB/s per shape) and, with --markdown, into
# README-ready markdown tables with each row's ratio of flash_attn to the best peer. Needs matplotlib for
# the PNG only; later files override earlier ones for the same device, implementation and shape.

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

OURS = "flash_attn"
COPY_CEILING = "copy_ceiling"
NOT_PEERS = (OURS, COPY_CEILING)
GIGA_PER_TERA = 1e3
KILO = 1024
PANEL_COLUMNS = 3
PANEL_SIZE_INCHES = (5.0, 3.6)
DPI = 120
BAR_GROUP_WIDTH = 0.8
OURS_LINE_WIDTH = 2.5
MATPLOTLIB_CYCLE = 10  # colors C0..C9; one per implementation, the same in every panel
DIRECTION_NAMES = {"fwd": "forward", "bwd": "backward"}


def load(paths) -> list:
    """Every row of every file, tagged with its device name and whether it is a decode row."""
    files = [(path, json.loads(Path(path).read_text())) for path in paths]
    several_devices = len({data.get("device_name") for _, data in files}) > 1
    rows = {}
    for path, data in files:
        if data.get("complete") is False:
            print(f"{path}: the run was cut off; it holds the {len(data['rows'])} rows it finished", file=sys.stderr)
        decode = bool(data.get("args", {}).get("decode"))
        for row in data["rows"]:
            tagged = dict(row, device_name=data.get("device_name", "?"), decode=decode)
            tagged["label"] = f"{row['impl']} @ {tagged['device_name']}" if several_devices else row["impl"]
            key = (tagged["device_name"], decode, row["impl"], row["dtype"], row["headdim"], row["causal"],
                   row["direction"], row["batch"], row["seqlen"], row.get("nheads"), row.get("nheads_k"),
                   row.get("feature", "none"), row.get("doc_len", 0))
            rows[key] = tagged
    return list(rows.values())


def rate(row):
    return row["tbps"] if row["decode"] else row["tflops"]


def unit_for(rows, decode: bool):
    """(label, multiplier): tera units unless every value is below one, then giga."""
    values = [rate(r) for r in rows if rate(r) is not None]
    big = any(v >= 1 for v in values)
    if decode:
        return ("TB/s", 1.0) if big else ("GB/s", GIGA_PER_TERA)
    return ("TFLOP/s", 1.0) if big else ("GFLOP/s", GIGA_PER_TERA)


def seqlen_label(seqlen: int) -> str:
    return f"{seqlen // KILO}k" if seqlen >= KILO and seqlen % KILO == 0 else str(seqlen)


def panel_key(row):
    if row["decode"]:
        return ("decode", row["dtype"])
    return ("train", row["dtype"], row["headdim"], row["causal"], row["direction"])


def panel_title(key) -> str:
    if key[0] == "decode":
        return f"decode, {key[1]}, K+V read once"
    _, dtype, headdim, causal, direction = key
    return f"{dtype}, headdim {headdim}, {'causal' if causal else 'non-causal'}, {DIRECTION_NAMES[direction]}"


def group_panels(rows) -> dict:
    panels = {}
    for row in rows:
        panels.setdefault(panel_key(row), []).append(row)
    return dict(sorted(panels.items(), key=lambda item: panel_order(item[0])))


def panel_order(key):
    """Training panels by dtype, headdim, non-causal first, forward first; decode panels last."""
    if key[0] == "decode":
        return (1, key[1], 0, False, 0)
    _, dtype, headdim, causal, direction = key
    return (0, dtype, headdim, causal, list(DIRECTION_NAMES).index(direction))


def label_order(label: str):
    """flash_attn first, the copy ceiling last, peers alphabetically between."""
    return (not label.startswith(OURS), label.startswith(COPY_CEILING), label)


def columns_of(rows) -> list:
    """x positions of a panel: seqlen for training rows, (batch, seqlen) for decode rows."""
    return sorted({(r["batch"], r["seqlen"]) if r["decode"] else r["seqlen"] for r in rows})


def column_of(row):
    return (row["batch"], row["seqlen"]) if row["decode"] else row["seqlen"]


def ratio_rows(rows, columns) -> dict:
    """device name -> ratios (flash_attn / best peer) per column; None where either side is missing."""
    ratios = {}
    for device in sorted({r["device_name"] for r in rows}):
        values = []
        for column in columns:
            here = [r for r in rows if r["device_name"] == device and column_of(r) == column]
            ours = next((rate(r) for r in here if r["impl"] == OURS), None)
            peers = [rate(r) for r in here if r["impl"] not in NOT_PEERS and rate(r) is not None]
            values.append(ours / max(peers) if ours is not None and peers else None)
        ratios[device] = values
    return ratios


# ---------------------------------------------------------------------------------------------
# Markdown


def markdown(rows) -> str:
    lines = []
    any_failed = False
    several_devices = len({r["device_name"] for r in rows}) > 1
    for key, panel in group_panels(rows).items():
        unit, scale = unit_for(panel, key[0] == "decode")
        columns = columns_of(panel)
        header = [f"{c[0]} × {seqlen_label(c[1])}" if isinstance(c, tuple) else seqlen_label(c) for c in columns]
        lines += [f"**{panel_title(key)}** ({unit})", "", "| implementation | " + " | ".join(header) + " |",
                  "|---|" + "---|" * len(columns)]
        labels = sorted({r["label"] for r in panel}, key=label_order)
        for label in labels:
            cells = []
            for column in columns:
                row = next((r for r in panel if r["label"] == label and column_of(r) == column), None)
                if row is None or rate(row) is None:
                    cells.append("—")
                    continue
                failed = row.get("check") == "fail"
                any_failed = any_failed or failed
                cells.append(f"{rate(row) * scale:.1f}" + ("!" if failed else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        for device, values in ratio_rows(panel, columns).items():
            name = f"{OURS} / best peer" + (f" @ {device}" if several_devices else "")
            cells = ["—" if v is None else f"{v:.2f}×" for v in values]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    if any_failed:
        lines.append("! = the implementation failed the correctness check on that shape.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# PNG


def plot(rows, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = group_panels(rows)
    all_labels = sorted({r["label"] for r in rows}, key=label_order)
    colors = {label: f"C{index % MATPLOTLIB_CYCLE}" for index, label in enumerate(all_labels)}
    ncols = min(PANEL_COLUMNS, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(PANEL_SIZE_INCHES[0] * ncols, PANEL_SIZE_INCHES[1] * nrows), squeeze=False
    )
    for ax, (key, panel) in zip(axes.flat, panels.items()):
        decode = key[0] == "decode"
        unit, scale = unit_for(panel, decode)
        labels = sorted({r["label"] for r in panel}, key=label_order)
        columns = columns_of(panel)
        for index, label in enumerate(labels):
            points = {column_of(r): rate(r) * scale for r in panel if r["label"] == label and rate(r) is not None}
            if not points:
                continue
            if decode:
                width = BAR_GROUP_WIDTH / len(labels)
                xs = [i + (index - (len(labels) - 1) / 2) * width for i, c in enumerate(columns) if c in points]
                ax.bar(xs, [points[c] for c in columns if c in points], width, label=label, color=colors[label])
            else:
                xs = [c for c in columns if c in points]
                style = {"linewidth": OURS_LINE_WIDTH} if label.startswith(OURS) else {}
                ax.plot(xs, [points[c] for c in xs], marker="o", label=label, color=colors[label], **style)
        if decode:
            ax.set_xticks(range(len(columns)))
            ax.set_xticklabels([f"{b} × {seqlen_label(s)}" for b, s in columns])
            ax.set_xlabel("batch × KV length")
        else:
            ax.set_xscale("log", base=2)
            ax.set_xticks(columns)
            ax.set_xticklabels([seqlen_label(c) for c in columns])
            ax.set_xlabel("seqlen")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.set_title(panel_title(key), fontsize="medium")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    print(f"wrote {out}")


def ratio_summary(rows, ours: str = "flash_attn") -> str:
    """One markdown row per shape: ours / best peer for forward, backward and forward+backward time
    (fwd+bwd compares the summed times, the issue bars' "forward+backward")."""
    times = {}
    for row in rows:
        if row["decode"] or row.get("ms") is None:
            continue
        shape = (row["dtype"], row["headdim"], row["causal"], row["seqlen"])
        times.setdefault(shape, {}).setdefault(row["impl"], {})[row["direction"]] = row["ms"]
    lines = ["| dtype | headdim | causal | seqlen | fwd | bwd | fwd+bwd |", "|---|---|---|---|---|---|---|"]
    for shape in sorted(times, key=lambda k: (k[0], k[1], k[2], k[3])):
        impls = times[shape]
        if ours not in impls:
            continue
        cells = []
        for directions in (("fwd",), ("bwd",), ("fwd", "bwd")):
            def total(impl):
                got = impls.get(impl, {})
                return sum(got[d] for d in directions) if all(d in got for d in directions) else None
            mine = total(ours)
            peers = [t for impl in impls if impl != ours for t in [total(impl)] if t is not None]
            cells.append(f"{min(peers) / mine:.2f}×" if mine and peers else "—")
        dtype, headdim, causal, seqlen = shape
        lines.append(f"| {dtype} | {headdim} | {'yes' if causal else 'no'} | {seqlen_label(seqlen)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def variant_label(row) -> str:
    """--sweep rows: the feature beside the plain call (softcap, window, alibi, varlen documents of N tokens)."""
    feature = row.get("feature", "none")
    if feature == "varlen":
        return f"varlen, documents of {row.get('doc_len', 0)}"
    return "" if feature == "none" else feature


def rate_summary(rows, ours: str = "flash_attn", reference: str = "sdpa_flash") -> str:
    """One markdown table with a row per shape: every implementation's forward / backward rate, then ours
    over `reference` (the issue bars compare with FlashAttention-2, torch's sdpa_flash, or cuDNN). Decode rows get
    their own table (one rate per implementation). Rows of --sweep files (GQA, features) add heads and feature
    columns."""
    table = {}
    for row in rows:
        if rate(row) is None:
            continue
        heads = f"{row.get('nheads', '?')}/{row.get('nheads_k', '?')}"
        shape = (row["decode"], row["dtype"], row["headdim"], row["causal"], row["batch"], row["seqlen"], heads,
                 variant_label(row))
        table.setdefault(shape, {}).setdefault(row["impl"], {})[row["direction"]] = rate(row)
    variants = any(s[7] for s in table) or any(len({s[6] for s in table if s[2] == hd}) > 1 for hd in
                                               {s[2] for s in table})
    out = []
    for decode in (False, True):
        shapes = sorted((s for s in table if s[0] == decode), key=lambda s: (s[1], s[3], s[7], s[2], s[6], s[5], s[4]))
        if not shapes:
            continue
        impls = sorted({impl for s in shapes for impl in table[s]}, key=lambda i: (i != ours, i))
        unit = "TB/s" if decode else "TFLOP/s fwd / bwd"
        extra = " heads | feature |" if variants else ""
        out.append(f"| dtype | hdim | causal | batch | seqlen{'_k' if decode else ''} |{extra} "
                   + " | ".join(impls) + f" | {ours} / {reference} |")
        out.append("|---" * (5 + (2 if variants else 0) + len(impls) + 1) + "|")
        for shape in shapes:
            cells = table[shape]
            def fmt(impl):
                got = cells.get(impl, {})
                return " / ".join(f"{got[d]:.0f}" if got[d] >= 10 else f"{got[d]:.1f}"
                                  for d in ("fwd", "bwd") if d in got) or "—"
            mine, ref = cells.get(ours, {}), cells.get(reference, {})
            ratio = " / ".join(f"{mine[d] / ref[d]:.2f}×" for d in ("fwd", "bwd") if d in mine and d in ref)
            _, dtype, headdim, causal, batch, seqlen, heads, variant = shape
            extra = f" {heads} | {variant or '—'} |" if variants else ""
            out.append(f"| {dtype} | {headdim} | {'yes' if causal else 'no'} | {batch} | {seqlen_label(seqlen)} |"
                       f"{extra} " + " | ".join(fmt(i) for i in impls) + f" | {ratio or '—'} |")
        out.append(f"\n({unit})\n")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Plot or tabulate bench_attention.py results.")
    parser.add_argument("results", nargs="+", help="results JSON files")
    parser.add_argument("--out", default=None, help="PNG path (default: the first file with .png)")
    parser.add_argument(
        "--markdown", action="store_true", help="print markdown tables; writes the PNG only if --out is given"
    )
    parser.add_argument("--ratios", action="store_true",
                        help="print one markdown table of flash_attn / best peer (fwd, bwd, fwd+bwd) per shape")
    parser.add_argument("--summary", action="store_true",
                        help="print one markdown table of every implementation's rates per shape, with "
                             "flash_attn / the --reference implementation")
    parser.add_argument("--reference", default="sdpa_flash",
                        help="--summary's ratio denominator (default sdpa_flash, FlashAttention-2; e.g. sdpa_cudnn)")
    args = parser.parse_args(argv)

    rows = load(args.results)
    if not rows:
        print("no rows in the given files", file=sys.stderr)
        return 1
    if args.ratios:
        print(ratio_summary(rows))
    if args.summary:
        print(rate_summary(rows, reference=args.reference))
    if args.markdown:
        print(markdown(rows))
    if args.out or not (args.markdown or args.ratios or args.summary):
        if importlib.util.find_spec("matplotlib") is None:
            print("plot.py needs matplotlib for the PNG: python3 -m pip install matplotlib", file=sys.stderr)
            return 1
        plot(rows, Path(args.out) if args.out else Path(args.results[0]).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
