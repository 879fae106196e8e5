#!/usr/bin/env python3
"""Writes an overlay directory for tools/ab_bench.sh: copies of tree files with exact text replacements, so a variant
is one command instead of hand-copied files (overlays live in the untracked .ab/ and do not outlive a session).
Each replacement must match exactly once in its file, or nothing is written.
Usage: python3 tools/make_overlay.py OVERLAY_DIR FILE OLD NEW [FILE OLD NEW ...]
e.g.   python3 tools/make_overlay.py .ab/smallpages csrc/dispatch/fwd_plan.cpp \\
           'kReadsSmallPages = false' 'kReadsSmallPages = true'
or     python3 tools/make_overlay.py OVERLAY_DIR --branch BRANCH [PATH ...]: the files of git branch BRANCH that differ
       from the working tree's HEAD (under PATH, default csrc and tests), so a branch runs as an A/B variant; refused
       when the branch deletes or renames a file, which an overlay cannot express."""

import subprocess
import sys
from pathlib import Path

ARGS_PER_EDIT = 3


def from_branch(overlay: Path, branch: str, paths: list[str]) -> int:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout

    changes = [line.split("\t") for line in git("diff", "--name-status", "HEAD", branch, "--", *paths).splitlines()]
    refused = [change for change in changes if change[0] not in ("M", "A")]
    if refused:
        print(f"make_overlay: {branch} deletes or renames {[c[-1] for c in refused]}; an overlay only adds or replaces "
              "files", file=sys.stderr)
        return 1
    for _, name in changes:
        target = overlay / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(git("show", f"{branch}:{name}"))
        print(f"{target}")
    return 0


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[2] == "--branch":
        return from_branch(Path(sys.argv[1]), sys.argv[3], sys.argv[4:] or ["csrc", "tests"])
    if len(sys.argv) < 2 + ARGS_PER_EDIT or (len(sys.argv) - 2) % ARGS_PER_EDIT:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path.cwd()
    overlay = Path(sys.argv[1])
    edits = [sys.argv[i:i + ARGS_PER_EDIT] for i in range(2, len(sys.argv), ARGS_PER_EDIT)]
    texts = {}
    for name, old, new in edits:
        text = texts.get(name)
        if text is None:
            source = overlay / name if (overlay / name).exists() else root / name
            text = source.read_text()
        count = text.count(old)
        if count != 1:
            print(f"make_overlay: {old!r} occurs {count} times in {name}; it must occur once", file=sys.stderr)
            return 1
        texts[name] = text.replace(old, new)
    for name, text in texts.items():
        target = overlay / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"{target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
