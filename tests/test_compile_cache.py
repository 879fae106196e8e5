# tools/compile_cache.py, the object cache of tools/ab_bench.sh's variant builds, with a stand-in compiler: a copy of
# the tree whose unit and included files match an earlier copy's reuses its object (depfile paths moved to the new
# copy); a changed header, flag or source compiles again.
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "compile_cache.py"
CXX_WRAPPER = ROOT / "tools" / "cxx_cache.sh"

# Compiles by concatenating the source and its one header into the object, counting each run; writes a gcc depfile.
FAKE_COMPILER = """
import pathlib, sys
args = sys.argv[1:]
out, dep, src = args[args.index("-o") + 1], args[args.index("-MF") + 1], args[args.index("-c") + 1]
header = pathlib.Path(src).parent / "unit.h"
pathlib.Path(out).write_text(pathlib.Path(src).read_text() + pathlib.Path(header).read_text() + " ".join(args))
pathlib.Path(dep).write_text(f"{out}: {src} \\\\\\n {header}\\n")
counter = pathlib.Path(sys.argv[0]).with_suffix(".count")
counter.write_text(str(int(counter.read_text() or 0) + 1) if counter.exists() else "1")
"""


@pytest.fixture
def setup(tmp_path):
    compiler = tmp_path / "fake_nvcc.py"
    compiler.write_text(FAKE_COMPILER)
    wrapper = tmp_path / "nvcc"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {compiler} \"$@\"\n")
    wrapper.chmod(0o755)
    return tmp_path, wrapper, compiler.with_suffix(".count")


def make_copy(base: pathlib.Path, name: str, header: str = "int x;\n") -> pathlib.Path:
    root = base / name
    (root / "csrc").mkdir(parents=True)
    (root / "build").mkdir()
    (root / "csrc" / "unit.cu").write_text("#include \"unit.h\"\n")
    (root / "csrc" / "unit.h").write_text(header)
    return root


def compile_in(root: pathlib.Path, wrapper: pathlib.Path, cache: pathlib.Path, flag: str = "-O3"):
    out = root / "build" / "unit.o"
    env = dict(os.environ, COMPILE_CACHE_DIR=str(cache), COMPILE_CACHE_ROOT=str(root))
    subprocess.run([sys.executable, str(TOOL), "--compiler", str(wrapper), "-MD", "-MF", f"{out}.d", f"-I{root}/csrc",
                    flag, "-c", str(root / "csrc" / "unit.cu"), "-o", str(out)], env=env, check=True)
    return out


def test_reuses_an_identical_copy(setup):
    base, wrapper, count = setup
    first = compile_in(make_copy(base, "a"), wrapper, base / "cache")
    second = compile_in(make_copy(base, "b"), wrapper, base / "cache")
    assert count.read_text() == "1"
    assert second.read_text() == first.read_text()
    depfile = pathlib.Path(f"{second}.d").read_text()
    assert str(base / "b" / "csrc" / "unit.h") in depfile and str(base / "a") not in depfile


def test_compiles_again_on_a_changed_header_or_flag(setup):
    base, wrapper, count = setup
    compile_in(make_copy(base, "a"), wrapper, base / "cache")
    changed = compile_in(make_copy(base, "b", header="int y;\n"), wrapper, base / "cache")
    assert count.read_text() == "2" and "int y;" in changed.read_text()
    compile_in(make_copy(base, "c"), wrapper, base / "cache", flag="-O2")
    assert count.read_text() == "3"
    compile_in(make_copy(base, "d", header="int y;\n"), wrapper, base / "cache")
    assert count.read_text() == "3"


def test_without_a_cache_it_only_compiles(setup):
    base, wrapper, count = setup
    root = make_copy(base, "a")
    for _ in range(2):
        out = root / "build" / "unit.o"
        env = dict(os.environ)
        env.pop("COMPILE_CACHE_DIR", None)
        subprocess.run([sys.executable, str(TOOL), "--compiler", str(wrapper), "-MD", "-MF", f"{out}.d", "-c",
                        str(root / "csrc" / "unit.cu"), "-o", str(out)], env=env, check=True)
    assert count.read_text() == "2"


def test_cxx_wrapper_passes_the_real_compiler(setup):
    """tools/cxx_cache.sh (CXX names one executable) runs the compiler COMPILE_CACHE_CXX names, through the cache."""
    base, wrapper, count = setup
    for name in ("a", "b"):
        root = make_copy(base, name)
        out = root / "build" / "unit.o"
        env = dict(os.environ, COMPILE_CACHE_DIR=str(base / "cache"), COMPILE_CACHE_ROOT=str(root),
                   COMPILE_CACHE_CXX=str(wrapper))
        subprocess.run([str(CXX_WRAPPER), "-MD", "-MF", f"{out}.d", "-c", str(root / "csrc" / "unit.cu"), "-o",
                        str(out)], env=env, check=True)
    assert count.read_text() == "1"
