"""The layering of docs/architecture.md, checked on every import statement (top level, in functions, under
TYPE_CHECKING alike): schemas <- store <- stages; models <- stages; pipeline on top; nothing imports pipeline;
a stage package never imports another stage package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "store", "models", "stages", "pipeline")
# Which project packages each layer may import (besides itself).
ALLOWED = {
    "schemas": set(),
    "store": {"schemas"},
    "models": {"schemas"},
    "stages": {"schemas", "store", "models"},
    "pipeline": {"schemas", "store", "models", "stages"},
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # `from stages.train import recipe` imports the module stages.train.recipe
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def project_modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_every_import_follows_the_layering():
    problems = []
    checked = 0
    for package in PACKAGES:
        for path in project_modules(package):
            rel = path.relative_to(ROOT)
            own_stage = rel.parts[1] if package == "stages" and len(rel.parts) > 2 else None
            for line, name in imports_of(path):
                top = name.split(".")[0]
                if top not in PACKAGES or top == package:
                    if top == "stages" and package == "stages" and own_stage is not None:
                        parts = name.split(".")
                        if len(parts) > 1 and (ROOT / "stages" / parts[1]).is_dir() and parts[1] != own_stage:
                            problems.append(f"{rel}:{line} imports another stage: {name}")
                    continue
                checked += 1
                if top not in ALLOWED[package]:
                    problems.append(f"{rel}:{line} ({package}) imports {name}")
    assert checked > 50, "the walk found too few project imports: is ROOT right?"
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_the_rule_check_catches_a_violation(tmp_path):
    """The walker sees imports inside functions and `from X import module` forms (it can fail)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from pipeline.config import load_config\n    from stages.train import recipe\n")
    names = [n for _, n in imports_of(f)]
    assert "pipeline.config" in names and "stages.train.recipe" in names


def test_stages_are_packages_with_an_entry():
    stages = sorted(p.name for p in (ROOT / "stages").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert stages == ["encode", "evaluate", "resize", "train"]
    assert not [p.name for p in (ROOT / "stages").glob("*.py") if p.name != "__init__.py"], "loose stage modules"
    entries = {"resize": "stage", "encode": "text", "train": "recipe", "evaluate": "stage"}
    for stage, module in entries.items():
        tree = ast.parse((ROOT / "stages" / stage / f"{module}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "run" for n in tree.body), f"stages/{stage}: no run()"
