"""Reads pip-audit's JSON report of the layer's pinned dependencies and says what it found.

Exit 1 when a dependency has a known vulnerability. When the vulnerability service could
not be reached, every dependency comes back "could not be audited": that is said plainly
(nothing was verified) and, unless KILN_AUDIT_STRICT=1, does not fail the build — a
machine without that service cannot tell either way.
"""

from __future__ import annotations

import json
import os
import sys


def main(path: str) -> int:
    with open(path, encoding="utf-8") as handle:
        report = json.load(handle)
    dependencies = report.get("dependencies", [])
    vulnerable = [d for d in dependencies if d.get("vulns")]
    skipped = [d for d in dependencies if d.get("skip_reason")]
    audited = len(dependencies) - len(skipped)
    for dependency in vulnerable:
        for vuln in dependency["vulns"]:
            fixes = ", ".join(vuln.get("fix_versions", [])) or "no fix yet"
            print(f"audit: {dependency['name']} {dependency.get('version', '')}: {vuln['id']} (fixed in {fixes})")
    print(f"audit: {audited} of {len(dependencies)} pinned dependencies audited, {len(vulnerable)} with known vulnerabilities")
    if vulnerable:
        return 1
    if skipped:
        print(f"audit: NOT VERIFIED: {len(skipped)} dependencies could not be audited "
              f"(vulnerability service unreachable?), e.g. {skipped[0]['skip_reason']}")
        return 1 if os.environ.get("KILN_AUDIT_STRICT") == "1" else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
