"""The project's documents hold together: every link between them resolves, and every document the
code cites exists, down to the section it names."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITATION = re.compile(r"(docs/[a-z_]+\.md)(?:, \"([^\"]+)\")?")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to
    '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def prose(path: Path) -> str:
    """The document without its code: fenced blocks and inline spans hold no links."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def headings(path: Path) -> list[str]:
    outside_code, found = True, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            outside_code = not outside_code
        elif outside_code and re.match(r"#+ ", line):
            found.append(line.lstrip("#").strip())
    return found


def test_every_link_between_the_documents_resolves():
    broken = []
    for document in DOCUMENTS:
        for target in LINK.findall(prose(document)):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, section = target.partition("#")
            path = (document.parent / file).resolve() if file else document
            if not path.exists():
                broken.append(f"{document.name}: {target} (no such file)")
            elif section and path.suffix == ".md":
                if section not in {anchor(h) for h in headings(path)}:
                    broken.append(f"{document.name}: {target} (no such section)")
    assert broken == []


def test_every_document_the_code_cites_exists_with_the_section_it_names():
    missing = []
    for source in [
        *(ROOT / "pipeline_assets").rglob("*.py"),
        *ROOT.glob("pipeline_assets_tests/**/*.py"),
    ]:
        for document, section in CITATION.findall(source.read_text()):
            path = ROOT / document
            if not path.exists():
                missing.append(f"{source.relative_to(ROOT)}: {document}")
            elif section and section not in headings(path):
                missing.append(f'{source.relative_to(ROOT)}: {document}, "{section}"')
    assert missing == []


def test_the_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
