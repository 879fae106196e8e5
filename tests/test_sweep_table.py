# tools/sweep_table.py, which writes the README's "beyond the table" rows from bench_attention.py --sweep files: plain
# cells against the faster of FA2's two entry points (the varlen one marked), feature cells against the plain call and
# FA2's varlen kernels, failed or missing runs left out.
import json

import pytest

from helpers import load_module


@pytest.fixture(scope="module")
def sweep_table():
    return load_module("tools/sweep_table.py")


def row(impl, tflops, feature="none", doc_len=0, direction="bwd", error=None, nheads_k=32):
    return {"impl": impl, "headdim": 128, "causal": True, "nheads": 32, "nheads_k": nheads_k, "feature": feature,
            "doc_len": doc_len, "direction": direction, "tflops": tflops, "error": error}


def write(path, rows):
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def test_cells_take_the_faster_fa2_entry_and_the_plain_call(sweep_table, tmp_path, capsys):
    rows = [row("flash_attn_portable", 187.0), row("sdpa_flash", 167.0), row("fa2_varlen", 196.0),
            row("flash_attn_portable", 288.0, direction="fwd"), row("sdpa_flash", 260.0, direction="fwd"),
            row("fa2_varlen", 222.0, direction="fwd"),
            row("flash_attn_portable", 114.0, feature="window"), row("fa2_varlen", 123.0, feature="window"),
            row("sdpa_flash", None, feature="window", error="RuntimeError: SDPA has no window"),
            row("flash_attn_portable", 44.0, feature="varlen", doc_len=128), row("fa2_varlen", 48.0, feature="varlen",
                                                                                   doc_len=128)]
    assert sweep_table.main([f"1k={write(tmp_path / 'a.json', rows)}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| hd | causal | heads | feature | 1k fwd | 1k bwd |"
    assert lines[2] == "| 128 | yes | 32/32 | — | 288 / 260 (1.11) | 187 / 196v (0.95) |"
    assert lines[3] == "| 128 | yes | 32/32 | window | — | 114 / 123 (0.93), −39 % |"
    assert lines[4] == "| 128 | yes | 32/32 | documents of 128 | — | 44 / 48 (0.92) |"


def test_gqa_forwards_leave_out_the_varlen_entry_whose_row_holds_the_kv_copy(sweep_table, tmp_path, capsys):
    rows = [row(impl, rate, direction=d, nheads_k=8) for impl, rate, d in (
        ("flash_attn_portable", 300.0, "fwd"), ("sdpa_flash", 290.0, "fwd"), ("fa2_varlen", 310.0, "fwd"),
        ("flash_attn_portable", 250.0, "bwd"), ("sdpa_flash", 240.0, "bwd"), ("fa2_varlen", 260.0, "bwd"))]
    assert sweep_table.main([f"4k={write(tmp_path / 'a.json', rows)}"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == "| 128 | yes | 32/8 | — | 300 / 290 (1.03) | 250 / 260v (0.96) |"


def test_arguments_name_their_column(sweep_table, tmp_path, capsys):
    assert sweep_table.main([str(tmp_path / "a.json")]) == 2
    assert "Usage" in capsys.readouterr().err
