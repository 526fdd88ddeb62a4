"""README is a reference that stays true: at most 350 lines, its layout table matches the tree
(every path it names exists, every top-level package and module of hcjax is in it), every
`python -m` module it names exists, and the figures it links live in docs/measurements.md's
current-figures table."""

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _section(title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def _layout_rows() -> list[tuple[str, str]]:
    rows = []
    for line in _section("Layout").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and not set(cells[0]) <= {"-", " "} \
                and cells[0] != "path":
            rows.append((cells[0], cells[1]))
    return rows


def test_readme_is_a_reference_of_at_most_350_lines():
    assert len(README.splitlines()) <= 350


def test_every_path_in_the_layout_table_exists():
    missing = []
    for path_cell, _ in _layout_rows():
        for path in re.findall(r"`([^`]+)`", path_cell):
            if not list(REPO.glob(path.rstrip("/"))):
                missing.append(path)
    assert not missing, f"layout table names paths that do not exist: {missing}"


def test_the_layout_table_covers_every_top_level_part_of_hcjax():
    rows = _layout_rows()
    named_paths = {p.rstrip("/") for cell, _ in rows for p in re.findall(r"`([^`]+)`", cell)}
    covered = set()
    for path in named_paths:
        covered.update(str(p.relative_to(REPO)) for p in REPO.glob(path))
    entry_rows = [contents for cell, contents in rows if "entry points" in cell]
    entry_names = {n for c in entry_rows for n in re.findall(r"`([a-z_0-9]+)`", c)}
    uncovered = []
    for item in sorted((REPO / "hcjax").iterdir()):
        rel = str(item.relative_to(REPO))
        if item.name.startswith(("_", ".")) or (item.is_file() and item.suffix != ".py"):
            continue
        if rel in covered or (item.suffix == ".py" and item.stem in entry_names):
            continue
        uncovered.append(rel)
    assert not uncovered, f"not in README's layout table: {uncovered}"


def test_every_python_m_module_in_readme_exists():
    names = set()
    for match in re.finditer(r"python -m (hcjax(?:\.[a-z_0-9]+)*)(?:\.\{([\w,]+)\})?", README):
        if match.group(2):
            names.update(f"{match.group(1)}.{n}" for n in match.group(2).split(","))
        else:
            names.add(match.group(1))
    for match in re.finditer(r"`hcjax\.(\w+)`, `hcjax\.(\w+)`", README):
        names.update(f"hcjax.{n}" for n in match.groups())
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    assert not missing, missing
    assert "hcjax.climb" in names and "hcjax.serve" in names


def test_figures_live_in_the_current_table_of_docs_measurements():
    doc = (REPO / "docs" / "measurements.md").read_text()
    table = re.search(r"^## Current figures\n(.*?)(?=^## )", doc, re.M | re.S)
    assert table, "docs/measurements.md has no '## Current figures' section above its history"
    header = next(line for line in table.group(1).splitlines() if line.startswith("|"))
    assert [c.strip() for c in header.strip("|").split("|")] == ["figure", "value", "command",
                                                                "date"]
    rows = [line for line in table.group(1).splitlines()
            if line.startswith("|") and not set(line) <= {"|", "-", " "}][1:]
    assert len(rows) >= 10
    assert "## History" in doc.split("## Current figures", 1)[1]
    assert "docs/measurements.md#current-figures" in README
