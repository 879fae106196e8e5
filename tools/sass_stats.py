# Opcode histogram of a kernel's hottest loop from its SASS, to count what one main-loop iteration issues
# before spending GPU time. The loop is the back edge (BRA to a lower address) whose body holds the most
# HMMA. It also lists the loops inside that one: each runs its body more than once per iteration while the static count
# holds it once (the backward's rolled tile loads at hd 192 were 78 static instructions, 37 % of what ran; ncu,
# thirty-fourth session), and what splits its schedule (schedule_notes). Usage: python3 tools/sass_stats.py
# OBJ_OR_CUBIN KERNEL_SUBSTRING [--all]
#   (cuobjdump comes with the toolkit, or with `pip install triton` under triton/backends/nvidia/bin)
import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton  # noqa: PLC0415  (only for its bundled binary)

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def kernels(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    out: dict[str, list[tuple[int, str, str]]] = {}
    name = None
    for line in sass.splitlines():
        head = re.match(r"\s+Function : (\S+)", line)
        if head:
            name = head.group(1)
            out[name] = []
            continue
        m = LINE.search(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


MATRIX_OPS = ("HMMA", "HGMMA")  # mma.sync (sm80) and wgmma (sm90)


def hottest_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The innermost loop holding matrix instructions (no such loop inside it) with the most of them: a Hopper
    kernel's tile loop holds its key loop and the peeled first and last key blocks, so "most matrix instructions"
    alone picked it; and the backward's step loop holds mbarrier wait loops without any, so "innermost" alone picked
    one of those."""
    loops = []
    for addr, op, args in code:
        target = re.search(r"0x([0-9a-f]+)", args)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))

    def matrix_ops(lo: int, hi: int) -> int:
        return sum(lo <= a <= hi and o.startswith(MATRIX_OPS) for a, o, _ in code)

    def crosses_shorter(lo: int, hi: int) -> bool:
        """Overlaps a shorter loop without matrix instructions and without holding it: an out-of-line retry path (e.g.
        an mbarrier wait's, placed after the kernel's body) branching back into a loop, not a loop of its own. A
        shorter crossing loop with matrix instructions is a rotated loop's entry: FA2's hd 96 forward enters its
        979-instruction key loop through a 238-instruction one whose back edge rarely runs (ncu execution counts,
        thirty-seventh session), and excluding the long loop picked the short one."""
        return any((a < lo <= b < hi or lo < a <= hi < b) and b - a < hi - lo and matrix_ops(a, b) == 0
                   for a, b in loops)

    with_mma = [(lo, hi) for lo, hi in loops if matrix_ops(lo, hi) > 0 and not crosses_shorter(lo, hi)]
    innermost = [(lo, hi) for lo, hi in with_mma
                 if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in with_mma)]
    best = max(innermost, key=lambda loop: matrix_ops(*loop), default=None)
    return [] if best is None else [ins for ins in code if best[0] <= ins[0] <= best[1]]


def inner_loops(body: list[tuple[int, str, str]]) -> list[tuple[int, int, collections.Counter]]:
    """The back edges inside a loop body other than its own: (first address, last address, opcode counts). Leaves out
    ELECT loops (one elected lane issues a TMA copy or reduction: ptxas wraps it in a loop that runs once)."""
    if not body:
        return []
    lo, hi = body[0][0], body[-1][0]
    out = []
    for addr, op, args in body:
        target = re.search(r"0x([0-9a-f]+)", args)
        if op.startswith("BRA") and target and lo < int(target.group(1), 16) < addr < hi:
            start = int(target.group(1), 16)
            inner = [o.split(".")[0] for a, o, _ in body if start <= a <= addr]
            if "ELECT" not in inner:
                out.append((start, addr, collections.Counter(inner)))
    return out


def schedule_notes(body: list[tuple[int, str, str]]) -> str:
    """Forward branches inside the loop (each skipped block ends a basic block, which ptxas does not schedule across),
    spill instructions, and the matrix instructions issued after the loop's last exponential (MUFU.EX2). In a forward
    key loop those are P V MMAs that could not interleave with the softmax: the portable hd 96 forward's one branch
    between them left all 96 after it, and ncu put 21 % of the kernel's samples on those MMAs' fixed-latency waits
    against FA2's 9 % (forty-third session; without the branch 20 of 96, +3-8 %)."""
    if not body:
        return ""
    hi = body[-1][0]
    skips = sum(1 for addr, op, args in body if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", args))
                and addr < int(t.group(1), 16) <= hi)
    spills = sum(1 for _, op, _ in body if op.startswith(("LDL", "STL")))
    exps = [i for i, (_, op, _) in enumerate(body) if op.startswith("MUFU.EX2")]
    mma = [i for i, (_, op, _) in enumerate(body) if op.startswith(MATRIX_OPS)]
    after = ""
    if exps:
        after = f", matrix instructions after the last exponential {sum(i > exps[-1] for i in mma)} of {len(mma)}"
    return f"  forward branches {skips}, spill instructions {spills}{after}"


def main() -> None:
    obj, want = sys.argv[1], sys.argv[2]
    sass = subprocess.run([cuobjdump(), "--dump-sass", obj], capture_output=True, text=True, check=True).stdout
    for name, code in kernels(sass).items():
        if want not in name:
            continue
        body = code if "--all" in sys.argv else hottest_loop(code)
        hist = collections.Counter(op.split(".")[0] for _, op, _ in body)
        print(f"{name}: {len(body)} instructions in {'the kernel' if '--all' in sys.argv else 'the hottest loop'}")
        print("  " + ", ".join(f"{op} {n}" for op, n in hist.most_common()))
        if "--all" not in sys.argv:
            print(schedule_notes(body))
            for start, end, ops in inner_loops(body):
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(4))
                print(f"  inner loop {start:#x}-{end:#x}: {sum(ops.values())} instructions, repeated within each iteration ({top})")


if __name__ == "__main__":
    main()
