"""Packaging guard, the import-direction rule (docs/DESIGN.md, "Packages") and the rule
that nothing in the repository points outside it."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "node": "atoll.node",
    "protocol": "atoll.protocol",
    "dht": "atoll.dht",
    "security": "atoll.security",
}
# who may import whom: dht and security only protocol; protocol nothing; node all
ALLOWED = {
    "atoll.protocol": {"atoll.protocol"},
    "atoll.dht": {"atoll.dht", "atoll.protocol"},
    "atoll.security": {"atoll.security", "atoll.protocol"},
    "atoll.node": {"atoll.node", "atoll.protocol", "atoll.dht", "atoll.security"},
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_on_disk_is_listed_for_the_wheel() -> None:
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    on_disk = set()
    for folder, name in PACKAGES.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *rel.parts]))
    assert on_disk == listed, (
        f"missing from packages: {on_disk - listed}; stale: {listed - on_disk}"
    )


def test_package_dirs_map_to_atoll_namespace() -> None:
    dirs = _pyproject()["tool"]["setuptools"]["package-dir"]
    assert dirs == {v: k for k, v in PACKAGES.items()}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; use the full atoll.* name")
    return out


def test_imports_point_one_way() -> None:
    wrong = []
    for folder, pkg in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            for mod in _imports(path):
                top = mod.split(".")
                if top[0] in PACKAGES:
                    wrong.append(f"{path.relative_to(ROOT)} imports bare {mod!r}")
                if top[0] == "atoll" and len(top) > 1:
                    target = ".".join(top[:2])
                    if target not in ALLOWED[pkg]:
                        wrong.append(f"{path.relative_to(ROOT)}: {pkg} must not import {target}")
    assert not wrong, "\n".join(wrong)


def test_protocol_does_not_import_torch() -> None:
    """The protocol core stays light: a bootstrap peer imports it without torch."""
    heavy = []
    for path in (ROOT / "protocol").rglob("*.py"):
        if {m.split(".")[0] for m in _imports(path)} & {"torch", "trio", "libp2p", "socket"}:
            heavy.append(str(path.relative_to(ROOT)))
    assert not heavy


def test_importing_the_protocol_loads_no_torch() -> None:
    code = "import sys, atoll.protocol; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_nothing_points_outside_the_repository() -> None:
    """Tracked files cite only in-repository documents, and every ``§N`` they cite of
    docs/ALGORITHMS.md is a section heading there. The needles are built from pieces so
    that this file can be scanned too."""
    import re

    algorithms = "ALGORITHMS" + ".md"
    outside = ("../" + "shared", "shared/" + "design", "ARCHITECTURE" + ".md", "ANCHORS" + ".md")
    bare = re.compile(r"(?<!docs/)\b" + re.escape(algorithms))
    cite = re.compile(re.escape("docs/" + algorithms) + r"`?((?:[\s,;]*(?:and\s+)?§[\d.]*\d)+)")
    doc = (ROOT / "docs" / algorithms).read_text()
    sections = set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", doc, re.M))
    assert {"1", "2", "2.4"} <= sections, "docs/ALGORITHMS.md lost its numbered sections"
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    wrong = []
    for rel in filter(None, listed.split("\0")):
        if rel.startswith("docs/results/") and rel.endswith(".json"):
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
            continue  # deleted in the work tree, a submodule, or binary
        for needle in outside:
            if needle in text:
                wrong.append(f"{rel}: mentions {needle!r}")
        if bare.search(text):
            wrong.append(f"{rel}: cites {algorithms} other than as docs/{algorithms}")
        cited = [m.group(1) for m in cite.finditer(text)]
        if rel == "docs/" + algorithms:
            cited.append(text)  # its own cross-references
        for group in cited:
            for sec in re.findall(r"§([\d.]*\d)", group):
                if sec not in sections:
                    wrong.append(f"{rel}: cites docs/{algorithms} §{sec}, which does not exist")
    assert not wrong, "\n".join(wrong)
