"""Runs several benchmarks/bench_attention.py argument lists in one process, so torch, the extension, CUDA and cuDNN
start once: tools/ab_bench.sh times each variant's plain run and its AB_HEADS_K / AB_ARG_SETS runs this way, one
process per variant and round (a process took 7-10 s for 12 rows in the forty-sixth session, ~3-4 s of it start-up).
Usage: python3 tools/bench_runs.py RUNS_FILE, run in the tree whose benchmark and extension are timed. Each line of
RUNS_FILE is a log path, a tab, and one run's arguments (shell words); a run's output goes to its log. A failed run
is reported on stderr and the others still run; the exit status is 1 if any failed."""

import contextlib
import shlex
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_attention  # noqa: E402


def parse_runs(text: str) -> list[tuple[Path, list[str]]]:
    runs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        log, tab, arguments = line.partition("\t")
        if not tab or not log:
            raise ValueError(f"line {number}: want 'LOG<tab>ARGUMENTS', got {line!r}")
        runs.append((Path(log), shlex.split(arguments)))
    return runs


def run_all(runs: list[tuple[Path, list[str]]], benchmark=bench_attention.run_benchmark) -> int:
    failed = 0
    for log, argv in runs:
        with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                benchmark(argv)
                ok = True
            except (Exception, SystemExit):  # argparse exits on bad arguments; the next run still goes
                traceback.print_exc()
                ok = False
        if not ok:
            failed += 1
            print(f"bench_runs: run failed ({log}): {shlex.join(argv)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(run_all(parse_runs(Path(sys.argv[1]).read_text())))
