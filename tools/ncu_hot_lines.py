# Reads the per-instruction CSV of tools/ncu_source.sh: totals of warp-stall samples by reason, samples per opcode,
# the SASS instructions that collect the most samples with their main reasons and how often each ran (x N: against
# the launch's tiles x warps this tells a per-tile wait from a per-block one; a retry branch shows the mbarrier wait
# before it), and (--sass, the `nvdisasm -gi -c`
# listing of a cubin built here with the same nvcc and flags, so offsets match) the samples per CUDA source line.
# Usage: python3 tools/ncu_hot_lines.py FILE.sass.csv [--top N] [--reason long_sb] [--sass LISTING]
import argparse
import collections
import csv
import re
import sys

STALL_PREFIX = "stall_"
WAIT_LOOKBACK = 6  # instructions between an mbarrier try-wait and the branch that retries it (ptxas schedules a few)


def read(path: str):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] in ("Address", "Line", "#"))
    header = rows[header_at]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) != len(header):
            continue
        out.append(dict(zip(header, r)))
    return header, out


def source_lines(listing: str, rows) -> dict:
    """Offset -> (innermost 'file:line', outermost 'file:line') for the function of `listing` whose instructions
    match the profiled rows (compared on the first instructions)."""
    functions, cur, chain, fresh = {}, None, [], True
    for line in open(listing):
        head = re.match(r"\.text\.(\S+):", line)
        if head:
            cur = functions.setdefault(head.group(1), {})
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            chain = [] if fresh else chain
            chain.append(f"{m.group(1).split('/')[-1]}:{m.group(2)}")
            fresh = False
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur is not None:
            cur[int(m.group(1), 16)] = (" ".join(m.group(2).split()), chain[0] if chain else "?", chain[-1] if chain else "?")
            fresh = True
    base = int(rows[0]["Address"], 16)
    probe = [(int(r["Address"], 16) - base, " ".join(r["Source"].split())) for r in rows[:64]]
    best = max(functions.values(), key=lambda f: sum(f.get(o, ("",))[0] == text for o, text in probe), default={})
    return {o: (inner, outer) for o, (_, inner, outer) in best.items()}, base


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--reason", help="rank by this stall reason (e.g. long_sb, barrier) instead of all samples")
    ap.add_argument("--sass", help="nvdisasm -gi -c listing of the same build, for source lines")
    args = ap.parse_args()
    header, rows = read(args.csv)
    reasons = [h for h in header if h.startswith(STALL_PREFIX) and "Not Issued" not in h]
    total = sum(num(r["Warp Stall Sampling (All Samples)"]) for r in rows) or 1.0
    by_reason = {h: sum(num(r[h]) for r in rows) for h in reasons}
    print(f"{args.csv}: {int(total)} samples")
    print("  " + ", ".join(f"{h[len(STALL_PREFIX):]} {100 * v / total:.1f}%"
                           for h, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v / total >= 0.005))
    src_col = "Source"
    by_op = collections.Counter()
    for r in rows:
        op = r[src_col].split()[0] if r[src_col].split() else "?"
        if op.startswith("@"):
            op = r[src_col].split()[1] if len(r[src_col].split()) > 1 else op
        by_op[op.split(".")[0]] += num(r["Warp Stall Sampling (All Samples)"])
    print("  by opcode: " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in by_op.most_common(12)))
    key = (STALL_PREFIX + args.reason) if args.reason else "Warp Stall Sampling (All Samples)"
    if key not in header:
        sys.exit(f"no column {key}")
    lines, base = source_lines(args.sass, rows) if args.sass else ({}, 0)

    def where(r) -> str:
        offset = int(r["Address"], 16) - base if args.sass else None
        inner, outer = lines.get(offset, ("", "")) if args.sass else ("", "")
        return f"{offset:05x} {outer:>18} {inner:>20}" if args.sass else r["Address"][-6:]

    def reasons_of(values: dict) -> str:
        top = sorted(((v, h[len(STALL_PREFIX):]) for h, v in values.items()), reverse=True)[:3]
        return " ".join(f"{n}:{int(v)}" for v, n in top if v)

    executed = "Instructions Executed"
    position = {id(r): i for i, r in enumerate(rows)}

    def barrier_wait(r) -> str:
        """The mbarrier try-wait a few instructions before a branch (the branch that retries it), if any."""
        if "BRA" not in r[src_col]:
            return ""
        i = position[id(r)]
        for back in rows[max(0, i - WAIT_LOOKBACK):i][::-1]:
            if "SYNCS.PHASECHK" in back[src_col]:
                return "  after " + " ".join(back[src_col].split()[-2:])
        return ""

    ranked = sorted(rows, key=lambda r: -num(r[key]))[: args.top]
    for r in ranked:
        s = num(r[key])
        if s == 0:
            break
        runs = f"x {int(num(r[executed]))}" if executed in r else ""
        print(f"  {100 * s / total:5.2f}%  {where(r)}  {r[src_col].strip()[:70]:<70} {runs:>11}  "
              + reasons_of({h: num(r[h]) for h in reasons}) + barrier_wait(r))
    if args.sass:
        per_line = collections.defaultdict(lambda: collections.Counter())
        for r in rows:
            line = lines.get(int(r["Address"], 16) - base, ("?", "?"))[1]
            per_line[line]["all"] += num(r[key])
            for h in reasons:
                per_line[line][h] += num(r[h])
        print("  by outermost source line:")
        for line, c in sorted(per_line.items(), key=lambda kv: -kv[1]["all"])[: args.top]:
            if c["all"] == 0:
                break
            print(f"  {100 * c['all'] / total:5.2f}%  {line:>20}  " + reasons_of({h: c[h] for h in reasons}))


if __name__ == "__main__":
    main()
