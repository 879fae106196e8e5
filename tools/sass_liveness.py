# Register state of a kernel's hottest loop (tools/sass_stats.py hottest_loop), counted from its SASS: registers read
# in the loop before any write in it (live-in), split into carried ones (also written: accumulators, fragments loaded
# for the next iteration) and invariant ones (addresses, bounds), each grouped by the opcode that reads it most. Tells
# where a kernel at 255 registers spends them before any change is timed (hd 96 forward, thirty-sixth session).
# Usage: python3 tools/sass_liveness.py OBJ_OR_CUBIN_OR_SASS KERNEL_SUBSTRING (a .sass file: cuobjdump's text, e.g. FA2's
# kernels out of libtorch_cuda.so with `cuobjdump -arch sm_90 -sass -fun NAME`)
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_stats  # noqa: E402  (this directory's helper)

REGISTER = re.compile(r"\bR(\d+)\b")
# Opcodes whose first operand is read, not written (stores, copies into shared memory, reductions, compares into
# predicates, control).
NO_DESTINATION = ("ST", "LDGSTS", "RED", "ATOM", "BAR", "BRA", "DEPBAR", "LDGDEPBAR", "ISETP", "FSETP", "NOP", "SYNCS",
                  "UTMA", "WARPSYNC", "EXIT", "RET", "CALL")
# Registers an operand spans beyond its first: mma.sync m16n8k16 takes D / A / C as four and B as two.
HMMA_WIDTHS = (4, 4, 2, 4)
VECTOR_WIDTHS = {".64": 2, ".128": 4}


def operand_width(op: str, index: int, count: int) -> int:
    if op.startswith("HMMA") and index < len(HMMA_WIDTHS):
        return HMMA_WIDTHS[index]
    if op.startswith("LDSM") and index == 0:  # cuobjdump spells ldmatrix .x4 / .x2 as LDSM.16.M88.4 / .2
        return 4 if op.endswith(".4") else 2 if op.endswith(".2") else 1
    for suffix, width in VECTOR_WIDTHS.items():
        if suffix in op and ((op.startswith("LD") and index == 0) or (op.startswith("ST") and index == count - 1)):
            return width
    return 1


def liveness(body: list[tuple[int, str, str]]):
    written: set[int] = set()
    live_in: set[int] = set()
    readers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for _, op, args in body:
        operands = [a.strip() for a in args.split(",")] if args.strip() else []
        destination: set[int] = set()
        for index, operand in enumerate(operands):
            for first in REGISTER.findall(operand):
                span = set(range(int(first), int(first) + operand_width(op, index, len(operands))))
                if index == 0 and not op.startswith(NO_DESTINATION) and "[" not in operand:
                    destination |= span
                    continue
                for reg in span:
                    readers[reg][op.split(".")[0]] += 1
                    if reg not in written:
                        live_in.add(reg)
        written |= destination  # an instruction reads its sources before it writes (HMMA's C, FMUL in place)
    return live_in, written, readers


def by_reader(regs: set[int], readers) -> str:
    counts = collections.Counter(readers[r].most_common(1)[0][0] for r in regs if readers[r])
    return ", ".join(f"{op} {n}" for op, n in counts.most_common())


def main() -> None:
    obj, want = sys.argv[1], sys.argv[2]
    if obj.endswith(".sass"):
        sass = Path(obj).read_text()
    else:
        sass = subprocess.run([sass_stats.cuobjdump(), "--dump-sass", obj], capture_output=True, text=True,
                              check=True).stdout
    for name, code in sass_stats.kernels(sass).items():
        if want not in name:
            continue
        body = sass_stats.hottest_loop(code)
        live_in, written, readers = liveness(body)
        carried, invariant = live_in & written, live_in - written
        spill_loads = sum(op.startswith("LDL") for _, op, _ in body)
        print(f"{name}: hottest loop {len(body)} instructions, {len(live_in)} live-in registers, {spill_loads} LDL")
        print(f"  carried {len(carried)} (by main reader: {by_reader(carried, readers)})")
        print(f"  invariant {len(invariant)} (by main reader: {by_reader(invariant, readers)})")


if __name__ == "__main__":
    main()
