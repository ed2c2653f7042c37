"""`kiln verify-build DIR`: checks a `sam build` output before it is deployed.

- every compiled module (ELF shared object) is for aarch64, the functions' architecture;
- every Python module has a python3.13 pyc beside it, hash-based (valid whatever the
  file dates in the zip), so a cold start never compiles;
- the streaming functions' run.sh is executable.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BuildReport", "check_build", "elf_machine", "pyc_problem"]

EM_AARCH64 = 183
MACHINES = {3: "x86", 62: "x86_64", 40: "arm", 183: "aarch64"}
# CPython 3.13's magic number (importlib.util.MAGIC_NUMBER of 3.13)
PY313_MAGIC = (3571).to_bytes(2, "little") + b"\r\n"
HASH_BASED = 0b01  # pyc flags bit 0: hash-based rather than timestamp-based


@dataclass
class BuildReport:
    shared_objects: int = 0
    modules: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def elf_machine(path: Path) -> int | None:
    """The ELF e_machine of a file, or None if it is not an ELF file."""
    with path.open("rb") as handle:
        header = handle.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    order = "<" if header[5] == 1 else ">"
    return struct.unpack(order + "H", header[18:20])[0]


def pyc_problem(source: Path) -> str | None:
    """What is wrong with the python3.13 pyc of `source`, or None."""
    pyc = source.parent / "__pycache__" / f"{source.stem}.cpython-313.pyc"
    if not pyc.exists():
        return "no python3.13 pyc"
    header = pyc.read_bytes()[:8]
    if header[:4] != PY313_MAGIC:
        return "pyc is not for python3.13"
    flags = int.from_bytes(header[4:8], "little")
    if not flags & HASH_BASED:
        return "pyc is timestamp-based (stale once zipped)"
    return None


def check_build(build_dir: Path) -> BuildReport:
    report = BuildReport()
    if not build_dir.is_dir():
        report.problems.append(f"{build_dir}: no such build directory")
        return report
    for path in sorted(build_dir.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        relative = path.relative_to(build_dir)
        if path.suffix == ".so" or ".so." in path.name:
            report.shared_objects += 1
            machine = elf_machine(path)
            if machine != EM_AARCH64:
                report.problems.append(f"{relative}: built for {MACHINES.get(machine, machine)}, not aarch64")
        elif path.suffix == ".py":
            report.modules += 1
            problem = pyc_problem(path)
            if problem:
                report.problems.append(f"{relative}: {problem}")
    for run_script in build_dir.glob("*/run.sh"):
        if not run_script.stat().st_mode & 0o111:
            report.problems.append(f"{run_script.relative_to(build_dir)}: not executable")
    return report


def main(build_dir: str) -> int:
    report = check_build(Path(build_dir))
    for problem in report.problems[:50]:
        print(f"verify-build: {problem}", file=sys.stderr)
    if len(report.problems) > 50:
        print(f"verify-build: … and {len(report.problems) - 50} more", file=sys.stderr)
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    print(
        f"verify-build: {report.shared_objects} compiled modules, all must be aarch64; "
        f"{report.modules} Python modules, all must be precompiled for python3.13: {verdict}"
    )
    return 0 if report.ok else 1

