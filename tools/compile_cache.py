#!/usr/bin/env python3
"""An object cache for the compiles of several copies of the tree (tools/ab_bench.sh variants): a translation unit
whose source, flags and every file it includes are the same as in a copy built before reuses that object. Usage:
setup.py sets it up when COMPILE_CACHE_DIR (the cache) is set, with COMPILE_CACHE_ROOT (this copy's root: its paths
are stored relative to it): as torch's nvcc (PYTORCH_NVCC="python3 tools/compile_cache.py") and as the C++ compiler
of its compile rules (tools/cxx_cache.sh, which passes --compiler). The real compiler is --compiler PATH (first
argument), else $CUDA_HOME/bin/nvcc. Without COMPILE_CACHE_DIR, or for a command that compiles nothing (links, -v),
it only runs the compiler. A reused object's line info names the source files of the copy that compiled it, which
hold the same text."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT_TOKEN = "@ROOT@"
DEPFILE_FLAGS = ("-MF", "--dependency-output")


COMPILER_FLAG = "--compiler"


def default_nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return str(pathlib.Path(home) / "bin" / "nvcc")


def option_value(args: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args[:-1]):
        if arg in names:
            return args[i + 1]
    return None


def file_digest(path: str) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def depfile_paths(text: str) -> list[str]:
    """The prerequisites of a make-style depfile ("out: src dep \\\n dep ...")."""
    body = text.replace("\\\n", " ").split(":", 1)[-1]
    return [word for word in body.split() if word != "\\"]


def relative(path: str, root: str) -> str:
    return ROOT_TOKEN + path[len(root):] if path.startswith(root + "/") else path


def absolute(path: str, root: str) -> str:
    return root + path[len(ROOT_TOKEN):] if path.startswith(ROOT_TOKEN) else path


def command_key(compiler: str, args: list[str], root: str, output: str, depfile: str | None) -> str:
    """What the object depends on besides the included files' contents: the flags and the source's place in the tree
    (the output and depfile paths name build directories, which differ between copies)."""
    words = [ROOT_TOKEN if arg == root else arg.replace(root + "/", ROOT_TOKEN + "/")
             for arg in args if arg not in (output, depfile)]
    return hashlib.sha256("\0".join([compiler, *words]).encode()).hexdigest()


def dependencies_match(entry: dict, root: str) -> bool:
    for path, digest in entry["deps"].items():
        try:
            if file_digest(absolute(path, root)) != digest:
                return False
        except OSError:
            return False
    return True


def restore(entry_dir: pathlib.Path, entry: dict, root: str, output: str, depfile: str | None) -> None:
    shutil.copyfile(entry_dir / entry["object"], output)
    if depfile:
        pathlib.Path(depfile).write_text(entry["depfile"].replace(ROOT_TOKEN, root))


def store(manifest: pathlib.Path, root: str, output: str, depfile: str) -> None:
    text = pathlib.Path(depfile).read_text()
    deps = {relative(path, root): file_digest(path) for path in depfile_paths(text)}
    name = hashlib.sha256(json.dumps(deps, sort_keys=True).encode()).hexdigest()[:32]
    manifest.mkdir(parents=True, exist_ok=True)
    # Written under temporary names and renamed: parallel builds may store the same unit at once.
    with tempfile.NamedTemporaryFile(dir=manifest, delete=False) as blob:
        blob.write(pathlib.Path(output).read_bytes())
    os.replace(blob.name, manifest / f"{name}.o")
    entry = {"object": f"{name}.o", "deps": deps, "depfile": text.replace(root + "/", ROOT_TOKEN + "/")}
    with tempfile.NamedTemporaryFile("w", dir=manifest, delete=False) as record:
        json.dump(entry, record)
    os.replace(record.name, manifest / f"{name}.json")


def main(args: list[str]) -> int:
    compiler = default_nvcc()
    if len(args) >= 2 and args[0] == COMPILER_FLAG:
        compiler, args = args[1], args[2:]
    compile_cmd = [compiler, *args]
    cache = os.environ.get("COMPILE_CACHE_DIR")
    root = os.environ.get("COMPILE_CACHE_ROOT", "").rstrip("/")
    output = option_value(args, ("-o",))
    depfile = option_value(args, DEPFILE_FLAGS)
    if not cache or not root or "-c" not in args or not output:
        return subprocess.call(compile_cmd)
    manifest = pathlib.Path(cache) / command_key(compiler, args, root, output, depfile)
    for record in sorted(manifest.glob("*.json")) if manifest.is_dir() else []:
        try:
            entry = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        if dependencies_match(entry, root):
            restore(manifest, entry, root, output, depfile)
            print(f"compile_cache: hit {output[len(root) + 1:]}", file=sys.stderr)
            return 0
    status = subprocess.call(compile_cmd)
    # Only a unit whose depfile names every included file can be reused safely.
    if status == 0 and depfile and pathlib.Path(depfile).is_file():
        store(manifest, root, output, depfile)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
