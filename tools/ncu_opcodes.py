# Executed-instruction counts of ncu source pages (tools/ncu_source.sh's *.sass.csv) side by side, by opcode and by how
# often each instruction ran: a kernel issue-bound on instructions its peer does not run (the portable hd 192 backward
# against FA2's: 1.50x as many, IPC alike) shows which opcodes and which loop the excess is in. Instructions that ran
# the same number of times form one group; a group running k times per key-block iteration is an inner loop.
# Usage: python3 tools/ncu_opcodes.py OURS.sass.csv PEER.sass.csv [--groups N]
import argparse
import collections
import csv

EXECUTED = "Instructions Executed"


def read(path: str) -> list[tuple[str, int, str]]:
    """(address, times executed, SASS text) of every instruction in an ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header = rows[header_at]
    out = []
    for r in rows[header_at + 1:]:
        if len(r) != len(header):
            continue
        row = dict(zip(header, r))
        out.append((row["Address"], int(row[EXECUTED].replace(",", "") or 0), row["Source"].strip()))
    return out


def opcode(sass: str) -> str:
    words = sass.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--groups", type=int, default=8, help="execution-count groups to list per file")
    args = ap.parse_args()
    kernels = [read(f) for f in args.files]
    per_op = [collections.Counter() for _ in kernels]
    for counts, code in zip(per_op, kernels):
        for _, n, sass in code:
            counts[opcode(sass)] += n
    totals = [sum(c.values()) for c in per_op]
    print("executed instructions: " + ", ".join(f"{f}: {t / 1e6:.1f} M" for f, t in zip(args.files, totals)))
    ops = sorted(set().union(*per_op), key=lambda o: -max(c[o] for c in per_op))
    print(f"{'opcode':<10}" + "".join(f"{'M #' + str(i + 1):>10}" for i in range(len(kernels))))
    for op in ops[:32]:
        print(f"{op:<10}" + "".join(f"{c[op] / 1e6:>10.1f}" for c in per_op))
    for f, code in zip(args.files, kernels):
        groups = collections.defaultdict(list)
        for addr, n, sass in code:
            if n:
                groups[n].append((addr, sass))
        # The main loop's count: the group that ran the most instructions in all.
        base = max(groups, key=lambda n: n * len(groups[n]), default=1)
        per_iteration = sum(c for _, c, _ in code) / base
        print(f"\n{f}: {per_iteration:.0f} instructions per main-loop iteration; the largest groups that ran equally "
              "often (x base: times per iteration)")
        for n, members in sorted(groups.items(), key=lambda kv: -kv[0] * len(kv[1]))[:args.groups]:
            share = n * len(members) / max(1, sum(c for _, c, _ in code))
            print(f"  {len(members):>5} instructions x {n:>11,} ({n / base:5.2f} x base) = {share:6.1%}: "
                  f"{members[0][1][:60]} ...")


if __name__ == "__main__":
    main()
