# tools/bench_runs.py, which runs tools/ab_bench.sh's benchmark runs of one variant and round in one process: each
# run's output in its own log, a failed run (bad arguments, an exception) reported while the others still run, and one
# real CPU run of benchmarks/bench_attention.py through it (checked, and with --no-check).
import json

import pytest

from helpers import load_module


@pytest.fixture(scope="module")
def bench_runs():
    return load_module("tools/bench_runs.py")


def test_lines_name_a_log_and_arguments(bench_runs, tmp_path):
    runs = bench_runs.parse_runs(f"{tmp_path}/a.log\t--headdim 64 --feature softcap\n\n{tmp_path}/b.log\t--doc-len 512\n")
    assert runs == [(tmp_path / "a.log", ["--headdim", "64", "--feature", "softcap"]),
                    (tmp_path / "b.log", ["--doc-len", "512"])]
    with pytest.raises(ValueError, match="line 1"):
        bench_runs.parse_runs("--headdim 64 without a log\n")


def test_a_failed_run_does_not_stop_the_others(bench_runs, tmp_path, capsys):
    seen = []

    def benchmark(argv):
        seen.append(argv)
        print(f"ran {argv}")
        if "--bad" in argv:
            raise SystemExit(2)
        if "--boom" in argv:
            raise RuntimeError("kernel failed")

    runs = [(tmp_path / "1.log", ["--bad"]), (tmp_path / "2.log", ["--boom"]), (tmp_path / "3.log", ["--ok"])]
    assert bench_runs.run_all(runs, benchmark) == 1
    assert seen == [["--bad"], ["--boom"], ["--ok"]]
    assert "SystemExit" in (tmp_path / "1.log").read_text()
    assert "kernel failed" in (tmp_path / "2.log").read_text()
    assert (tmp_path / "3.log").read_text() == "ran ['--ok']\n"
    assert capsys.readouterr().err.count("run failed") == 2
    assert bench_runs.run_all(runs[2:], benchmark) == 0


def test_runs_the_benchmark_on_the_cpu(bench_runs, tmp_path):
    common = "--device cpu --impls sdpa_math --headdim 32 --seqlen 64 --causal both --reps 1"
    runs = bench_runs.parse_runs(f"{tmp_path}/f.log\t{common} --direction fwd --out {tmp_path}/f.json\n"
                                 f"{tmp_path}/b.log\t{common} --direction bwd --out {tmp_path}/b.json\n"
                                 f"{tmp_path}/n.log\t{common} --direction bwd --no-check --out {tmp_path}/n.json\n")
    assert bench_runs.run_all(runs) == 0
    for name, direction, check in (("f", "fwd", "pass"), ("b", "bwd", "pass"), ("n", "bwd", "not checked")):
        rows = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        assert len(rows) == 2 and {row["direction"] for row in rows} == {direction}
        assert all(row["check"].startswith(check) and row["tflops"] > 0 for row in rows)
