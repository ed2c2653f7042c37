"""`make mutation`: mutmut over the layer's pure modules, in a copy of the tree.

Run by the tool environment's Python (.tools/mutation, see the Makefile). Nothing in the
working tree is touched: the modules, the unit tests that cover them and the files those
tests read are copied (as they are in the working tree, committed or not) into
.tools/mutation/work, laid out so that `kiln` is a top-level package there (mutmut names
mutants after their file's path, and the tests import `kiln.*`), and mutmut mutates that copy.

    make mutation                      every module below
    make mutation MODULES="metering sse"   only these (names as in MODULES)

It prints each module's score (killed / mutants) and a summary, and exits 1 when a module
is under the bar (docs/mutation.md has the last scores and the mutants judged equivalent).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = "layers/gateway/kiln"
# the tool environment's own folder (.tools/mutation): the copy lives beside its mutmut
TOOLS = Path(sys.prefix)
WORK = TOOLS / "work"
MUTMUT = str(TOOLS / "bin" / "mutmut")
# the modules with no I/O of their own, and the unit tests that say what they do
MODULES = {
    "metering": "kiln/metering.py",
    "normalize": "kiln/normalize.py",
    "sse": "kiln/sse.py",
    "errors": "kiln/errors.py",
    "jsonio": "kiln/jsonio.py",
    "catalog": "kiln/catalog.py",
    # each endpoint's rules (base, chat, completions, responses), scored as one package
    "apis": "kiln/apis/*",
}
TESTS = ("metering", "normalize", "sse", "errors", "jsonio", "catalog", "apis")
# what those tests read besides the modules
ALSO_COPY = ("infra/catalog.json", "docs/design.md")
BAR = 90.0
KILLED = {"killed", "timeout", "segfault", "caught by type check"}
_RESULT = re.compile(r"^\s*(kiln\.[^:]+): (.+)$")


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def tracked_and_new(*paths: str) -> list[str]:
    """The files git knows of under `paths`, or would (untracked but not ignored)."""
    listing = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\n")
    return sorted({name for name in listing if name and (ROOT / name).is_file()})


def prepare(modules: list[str]) -> list[str]:
    """A fresh copy of what the run needs under WORK, and mutmut's configuration for it."""
    shutil.rmtree(WORK, ignore_errors=True)
    for name in tracked_and_new(LAYER, "tests/unit", *ALSO_COPY):
        target = WORK / ("kiln" + name[len(LAYER):] if name.startswith(LAYER + "/") else name)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, target)
    tests = sorted(
        str(path.relative_to(WORK))
        for path in (WORK / "tests" / "unit").glob("test_unit_*.py")
        if path.stem.removeprefix("test_unit_").startswith(TESTS)
    )
    (WORK / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["kiln"]\n'
        f"only_mutate = {[MODULES[module] for module in modules]!r}\n"
        'also_copy = ["infra", "docs"]\n'
        # the repository's tests/conftest.py (the embedded AWS, the mock server) is not copied
        'pytest_add_cli_args = ["-p", "no:cacheprovider", "-q"]\n'
        f"pytest_add_cli_args_test_selection = {tests!r}\n"
        "use_git_change_detection = false\n\n"
        "[tool.pytest.ini_options]\n"
        'addopts = "--strict-markers"\n'
    )
    return tests


def results() -> tuple[dict[str, Counter], dict[str, list[str]]]:
    out = subprocess.run(
        [MUTMUT, "results", "--all", "true"],
        cwd=WORK, check=True, capture_output=True, text=True,
    ).stdout
    by_module: dict[str, Counter] = defaultdict(Counter)
    alive: dict[str, list[str]] = defaultdict(list)
    for line in out.splitlines():
        match = _RESULT.match(line)
        if match:
            name, status = match.groups()
            module = name.split(".x_")[0].split(".xǁ")[0].removeprefix("kiln.")
            module = "apis" if module.startswith("apis.") else module
            by_module[module][status] += 1
            if status not in KILLED:
                alive[module].append(f"{name} ({status})")
    return by_module, alive


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", metavar="MODULE", help=", ".join(MODULES))
    parser.add_argument("--max-children", type=int, default=1, help="mutants run at once (default 1)")
    args = parser.parse_args()
    modules = args.modules or list(MODULES)
    if not Path(MUTMUT).exists():
        parser.error(f"no {MUTMUT}: run this with the tool environment's Python (make mutation)")
    unknown = [module for module in modules if module not in MODULES]
    if unknown:
        parser.error(f"unknown module {', '.join(unknown)}; the modules are {', '.join(MODULES)}")
    tests = prepare(modules)
    print(f"mutating {', '.join(modules)} in {shown(WORK)}; tests: {', '.join(tests)}", flush=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run(
        [MUTMUT, "run", "--max-children", str(args.max_children)],
        cwd=WORK, env=env, stdout=subprocess.DEVNULL,
    )
    if run.returncode != 0:
        print(f"mutmut run failed (exit {run.returncode}); see {shown(WORK)}", file=sys.stderr)
        return run.returncode
    by_module, alive = results()
    below = []
    total = Counter()
    print(f"\n{'module':<18} {'killed':>7} {'mutants':>8} {'score':>7}  survivors")
    for module in modules:
        counts = by_module.get(module, Counter())
        total += counts
        killed, mutants = sum(counts[s] for s in KILLED), sum(counts.values())
        score = 100.0 * killed / mutants if mutants else 100.0
        others = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()) if s not in KILLED)
        print(f"{module:<18} {killed:>7} {mutants:>8} {score:>6.1f}%  {others}")
        if score < BAR:
            below.append(module)
    killed, mutants = sum(total[s] for s in KILLED), sum(total.values())
    print(f"{'all':<18} {killed:>7} {mutants:>8} {100.0 * killed / max(mutants, 1):>6.1f}%")
    print("\nmutants not killed (docs/mutation.md says which are equivalent, and why):")
    for module in modules:
        for name in alive.get(module, []):
            print(f"  {name}")
    print(f"a mutant's diff: cd {shown(WORK)} && ../bin/mutmut show NAME")
    if below:
        print(f"under {BAR:.0f} %: {', '.join(below)}")
        return 1
    print(f"every module at {BAR:.0f} % or more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
