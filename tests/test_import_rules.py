"""The layering of docs/architecture.md, checked on every import statement (top level, in functions, under
TYPE_CHECKING alike): schemas <- store <- features <- stages; models <- stages; pipeline on top; nothing imports
pipeline; a stage package never imports another stage package; store/ knows tables, not stages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "store", "features", "models", "stages", "pipeline")
# Which project packages each layer may import (besides itself).
ALLOWED = {
    "schemas": set(),
    "store": {"schemas"},
    "features": {"schemas", "store"},
    "models": {"schemas"},
    "stages": {"schemas", "store", "features", "models"},
    "pipeline": {"schemas", "store", "features", "models", "stages"},
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


# What a stage concept looks like in code: a stage's name as a string, or the stage-side names that lived in
# store/ before they moved to features/ (which stage writes a table, the stage order, opening the features).
STAGE_NAMES = ("resize-bucket", "encode-text", "encode-vae")
STAGE_SIDE = {"STAGE_OF", "TABLE_ORDER", "PRODUCER", "open_features", "open_configured", "_PRODUCER"}


def stage_concepts_in(path: Path) -> list[str]:
    """Stage names in string constants (docstrings aside: they may say who calls) and stage-side names defined
    or used in one module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found += [f"{node.lineno}: string {s!r}" for s in STAGE_NAMES if s in node.value]
        name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                else node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None)
        if name in STAGE_SIDE:
            found.append(f"{node.lineno}: name {name}")
    return found


def test_the_store_knows_tables_not_stages():
    problems = [f"{p.relative_to(ROOT)}:{line}" for p in project_modules("store") for line in stage_concepts_in(p)]
    assert not problems, "stage concepts in store/ (they belong in features/):\n" + "\n".join(problems)


def test_the_stage_concept_check_can_fail(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('"""Called by encode-text."""\nSTAGE_OF = {"text": "encode-text"}\n')
    assert stage_concepts_in(f) == ["2: name STAGE_OF", "2: string 'encode-text'"]
