"""The docs tell the truth about the code: the references are generated from it and current, every config key
has a description, and every test the docs cite as a proof exists. (`mkdocs build --strict`, which fails on a
broken link or a page missing from the site, runs in `make test` before pytest.)"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests import docgen

REPO = docgen.REPO
CITED = re.compile(r"tests/(test_\w+\.py)(?:::(\w+))?(?:::(\w+))?")


@pytest.mark.parametrize("page", sorted(docgen.PAGES))
def test_each_generated_reference_page_matches_the_code(page):
    committed = (docgen.REFERENCE / page).read_text(encoding="utf-8")
    assert committed == docgen.PAGES[page](), f"docs/reference/{page} is stale: run `make docs-ref` and commit it"


@pytest.mark.parametrize("model", ["pipeline.core.config:RunConfig", "pipeline.core.capture_config:CaptureConfig",
                                   "pipeline.prompts.spec:SourceSpecFile"])
def test_every_config_key_has_a_description(model):
    import importlib

    module, name = model.split(":")
    missing = docgen.fields_without_description(getattr(importlib.import_module(module), name))
    assert not missing, f"keys without Field(description=...): {missing}"


def cited_tests(text: str) -> set[tuple[str, str | None, str | None]]:
    return {match.groups() for match in CITED.finditer(text)}


def defined_tests(module: Path) -> set[str]:
    """`name` and `Class::name` of every test function a test module defines (read, not imported)."""
    names: set[str] = set()
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_the_docs_cite_tests_as_proofs():
    assert sum(len(cited_tests(f.read_text(encoding="utf-8"))) for f in doc_files()) >= 20


def test_every_test_the_docs_cite_exists():
    missing = []
    for doc in doc_files():
        for module, first, second in sorted(cited_tests(doc.read_text(encoding="utf-8")), key=str):
            path = REPO / "tests" / module
            name = "::".join(part for part in (first, second) if part)
            if not path.is_file():
                missing.append(f"{doc.relative_to(REPO)}: tests/{module} does not exist")
            elif name and name not in defined_tests(path):
                missing.append(f"{doc.relative_to(REPO)}: tests/{module}::{name} does not exist")
    assert not missing, "\n".join(missing)


def heading_anchors(page: Path) -> set[str]:
    """The anchors MkDocs gives a page's headings (its toc slugify: lowercase, punctuation dropped, spaces to -)."""
    anchors = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            anchors.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return anchors


def test_every_link_of_the_readme_reaches_a_file_and_its_heading():
    """README.md is outside the site, so `mkdocs build --strict` does not see its links."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text(encoding="utf-8")):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in heading_anchors(REPO / path):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, "\n".join(broken)
