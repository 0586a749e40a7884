"""Every relative link in README.md and docs/*.md resolves: the file exists and, for `#anchor`, a heading of that
file has that GitHub anchor. The shipped workflows' notes link to docs pages by their GitHub address; those pages
and anchors must exist here too. The checker itself is tested on a temporary page with a broken link."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "https://github.com/comfyui-int8-accel/comfyui-int8-accel/blob/main/"

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {anchor(h) for h in _HEADING.findall(text)}


def links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text(encoding="utf-8")))


def broken_target(base: Path, page: Path, target: str) -> str | None:
    """Why `target`, linked from `page` (relative to the folder `base`), does not resolve; None when it does."""
    path, _, fragment = target.partition("#")
    resolved = (base / path).resolve() if path else page.resolve()
    if not resolved.exists():
        return f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}: {target} (no such file)"
    if fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
        return f"{page.name}: {target} (no heading with anchor #{fragment})"
    return None


def broken_links(page: Path) -> list[str]:
    """The relative links of a markdown page that do not resolve (web addresses and mailto are not checked)."""
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        problem = broken_target(page.parent, page, target)
        if problem:
            problems.append(problem)
    return problems


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_relative_link_in_readme_and_docs_resolves():
    problems = [p for page in doc_pages() for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_finds_a_broken_file_link_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md) [fine too](other.md#a-section) [own](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no anchor](other.md#no-such-section)\n\n"
        "```\n[in a code block](ignored.md)\n```\n", encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "missing.md (no such file)" in problems[0]
    assert "#no-such-section" in problems[1]


def test_anchor_matches_githubs_rule():
    assert anchor("What the first run found (H200, 2026-11-26)") == "what-the-first-run-found-h200-2026-11-26"
    assert anchor("ComfyUI's weight-management contracts") == "comfyuis-weight-management-contracts"
    assert anchor("`make test-gpu`: the GPU suite from this checkout") == "make-test-gpu-the-gpu-suite-from-this-checkout"


def test_every_shipped_workflow_note_links_to_a_docs_page_that_exists():
    for graph in sorted((ROOT / "workflows").glob("*.json")):
        notes = [n for n in json.loads(graph.read_text(encoding="utf-8"))["nodes"] if n["type"] == "MarkdownNote"]
        text = "\n".join(n["widgets_values"][0] for n in notes)
        targets = [t for t in re.findall(r"\]\((\S+?)\)", text) if t.startswith(REPOSITORY + "docs/")]
        assert targets, f"{graph.name}: its note links to no docs page"
        for target in targets:
            problem = broken_target(ROOT, graph, target[len(REPOSITORY):])
            assert problem is None, f"{graph.name}: {problem}"


# --- the docs stay a reference: sizes, and no history outside the changelog and the results READMEs -----------
KB = 1000
SIZE_LIMITS = {  # bytes of each page at most (issue 47); every other page counts in the docs/ total only
    "README.md": 5 * KB, "docs/int8.md": 8 * KB, "docs/deepcache.md": 8 * KB, "docs/compile.md": 6 * KB,
    "docs/gpu.md": 6 * KB, "docs/compatibility.md": 8 * KB, "docs/benchmarks.md": 8 * KB,
    "docs/architecture.md": 6 * KB,
}
DOCS_TOTAL_LIMIT = 50 * KB
# Words that tell what was found when rather than what holds; dated findings go to CHANGELOG.md or the README.md
# of their bench/results/ folder.
HISTORY_PHRASES = ("before", "earlier", "now", "previously", "used to", "no longer", "fixed", "not yet")
_HISTORY = re.compile(r"\b(" + "|".join(re.escape(p).replace(r"\ ", r"\s+") for p in HISTORY_PHRASES) + r")\b", re.I)
_COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def history_pages() -> list[Path]:
    """Where history belongs: the changelog and the results folders' READMEs (their links are checked too)."""
    return [ROOT / "CHANGELOG.md", *sorted((ROOT / "bench" / "results").glob("**/README.md"))]


def page_sizes() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_bytes()) for p in doc_pages()}


def history_in(page: Path) -> list[str]:
    """`page:line: phrase` for each history phrase or commit hash in the page's prose (code blocks excluded)."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text(encoding="utf-8"))
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in [*_HISTORY.finditer(line), *_COMMIT.finditer(line)]:
            found.append(f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name}:{number}: "
                         f"{match.group(0)!r} in {line.strip()[:120]!r}")
    return found


def test_readme_and_each_docs_page_stay_within_their_sizes():
    sizes = page_sizes()
    docs_total = sum(size for name, size in sizes.items() if name.startswith("docs/"))
    print("\n" + "\n".join(f"{name}: {size} bytes" for name, size in sorted(sizes.items()))
          + f"\ndocs/ total: {docs_total} bytes (limit {DOCS_TOTAL_LIMIT})")
    over = [f"{name}: {sizes[name]} > {limit}" for name, limit in SIZE_LIMITS.items() if sizes[name] > limit]
    assert not over, "pages over their size: " + "; ".join(over)
    assert docs_total <= DOCS_TOTAL_LIMIT, f"docs/ holds {docs_total} bytes, over {DOCS_TOTAL_LIMIT}"


def test_readme_and_docs_say_what_holds_without_history_or_commit_hashes():
    found = [f for page in doc_pages() for f in history_in(page)]
    assert not found, "history belongs in CHANGELOG.md or bench/results/*/README.md:\n" + "\n".join(found)


def test_every_relative_link_in_the_changelog_and_the_results_readmes_resolves():
    problems = [p for page in history_pages() for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_history_check_finds_history_words_and_hashes_but_not_their_look_alikes(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\nIt is now faster than it was before commit 9cb6b5e; it no\nlonger waits.\n"
                    "Known, nowhere, beforehand, a 1024x1024 latent, decade, 12345678.\n\n"
                    "```\nbefore in a code block\n```\n", encoding="utf-8")
    found = history_in(page)
    assert [f.split(": ")[1].split(" in ")[0] for f in found] == ["'now'", "'before'", "'9cb6b5e'"], found
