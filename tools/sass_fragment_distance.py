# How far ahead a kernel's hottest loop loads its mma.sync fragments: for each HMMA, the instructions since the ldmatrix
# (LDSM) that last wrote one of its A / B registers, binned, for the MMAs fed from plain ldmatrix (S = Q K^T) and from
# transposed ones (P V's V). The portable hd 96 forward's S GEMM issued 59 of 96 MMAs within 10 instructions of their
# loads where FA2's keeps 72 of 96 at 25 or more (thirty-seventh session), which ncu saw as short-scoreboard stalls.
# Usage: python3 tools/sass_fragment_distance.py OBJ_OR_CUBIN_OR_SASS KERNEL_SUBSTRING (as tools/sass_liveness.py)
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_liveness  # noqa: E402  (this directory's helpers)
import sass_stats  # noqa: E402

REGISTER = re.compile(r"\bR(\d+)\b")
BINS = (10, 25)  # distances below 10, 10-24 and 25 or more instructions
HMMA_SOURCES = (1, 2)  # operand indices of A and B


def span(op: str, operands: list[str], index: int) -> set[int]:
    first = REGISTER.findall(operands[index])
    if not first:
        return set()
    width = sass_liveness.operand_width(op, index, len(operands))
    return set(range(int(first[0]), int(first[0]) + width))


def distances(body: list[tuple[int, str, str]]) -> dict[str, collections.Counter]:
    loaded_at: dict[int, tuple[int, bool]] = {}  # register -> (position, from a transposed ldmatrix)
    out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for position, (_, op, args) in enumerate(body):
        operands = [a.strip() for a in args.split(",")] if args.strip() else []
        if not operands:
            continue
        if op.startswith("LDSM"):
            for reg in span(op, operands, 0):
                loaded_at[reg] = (position, ".MT" in op)
        elif op.startswith("HMMA"):
            sources = [loaded_at[r] for i in HMMA_SOURCES for r in span(op, operands, i) if r in loaded_at]
            if sources:
                last, _ = max(sources)
                kind = "P V (transposed B)" if any(t for _, t in sources) else "S (plain ldmatrix)"
                distance = position - last
                out[kind][sum(distance >= b for b in BINS)] += 1
            for reg in span(op, operands, 0):
                loaded_at.pop(reg, None)
        elif not op.startswith(sass_liveness.NO_DESTINATION) and "[" not in operands[0]:
            for reg in span(op, operands, 0):
                loaded_at.pop(reg, None)
    return out


def main() -> None:
    obj, want = sys.argv[1], sys.argv[2]
    if obj.endswith(".sass"):
        sass = Path(obj).read_text()
    else:
        sass = subprocess.run([sass_stats.cuobjdump(), "--dump-sass", obj], capture_output=True, text=True,
                              check=True).stdout
    labels = (f"< {BINS[0]}", f"{BINS[0]}-{BINS[1] - 1}", f">= {BINS[1]}")
    for name, code in sass_stats.kernels(sass).items():
        if want not in name:
            continue
        body = sass_stats.hottest_loop(code)
        print(f"{name}: hottest loop {len(body)} instructions; MMAs by instructions since their ldmatrix")
        for kind, counts in sorted(distances(body).items()):
            print(f"  {kind}: " + ", ".join(f"{label}: {counts[i]}" for i, label in enumerate(labels)))


if __name__ == "__main__":
    main()
