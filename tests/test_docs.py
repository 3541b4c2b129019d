"""The manual's code blocks (README.md and docs/**/*.md): every fenced block is either run by a test or marked as
not run, with why. The mark is an HTML comment on the line before the block, or at the end of that line (inside a
list item, where a line of its own would end the item):

    <!-- run by tests/spark/test_readme.py: the step-by-step block -->
    <!-- not run: needs a Databricks workspace -->

A ``run by`` mark names a test file that exists and reads the page (it names the page's file). The README's two
commands are ``make demo`` and ``make test``, the Makefile's targets. No Spark, no emulator: fast."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
MARK = re.compile(r"<!-- (?:run by (?P<test>tests/\S+?\.py)(?::[^>]*)?|not run[^:>]*: (?P<why>[^>]*\S)) -->\s*$")
TWO_COMMANDS = ["make demo", "make test"]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    info: str
    mark: str  # the line before it
    body: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of ``page`` (or of ``text``, read as that page), in order."""
    lines = (page.read_text() if text is None else text).splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening["fence"]
        end = i + 1
        while end < len(lines):
            closing = FENCE.match(lines[end])
            if closing and closing["fence"][0] == fence[0] and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            end += 1
        body = "\n".join(line.removeprefix(opening["indent"]) for line in lines[i + 1:end])
        found.append(Block(page, i + 1, opening["info"].strip(), lines[i - 1] if i else "", body))
        i = end + 1
    return found


def problems(block: Block) -> list[str]:
    """What is wrong with ``block``'s mark: nothing, or why."""
    mark = MARK.search(block.mark)
    if mark is None:
        return [f"{block.where}: a {block.info or 'plain'} block with neither '<!-- run by tests/....py: ... -->' nor "
                "'<!-- not run: why -->' on the line before it"]
    if mark["test"] is None:
        return []
    test = ROOT / mark["test"]
    if not test.is_file():
        return [f"{block.where}: the block is marked as run by {mark['test']}, which does not exist"]
    if block.page.name not in test.read_text():
        return [f"{block.where}: {mark['test']} never names {block.page.name}, so it cannot be what runs this block"]
    return []


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def test_there_are_pages_and_blocks() -> None:
    assert (ROOT / "docs" / "index.md") in PAGES and len(PAGES) > 10
    assert len(all_blocks()) > 40


def test_every_block_is_run_by_a_test_or_marked_as_not_run() -> None:
    found = [problem for block in all_blocks() for problem in problems(block)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("text", "expected"), [
    ("Some text:\n\n```python\nx = 1\n```\n", "neither"),
    ("<!-- not run -->\n```python\nx = 1\n```\n", "neither"),  # a mark without its why
    ("<!-- run by tests/no_such_test.py: x -->\n```python\nx = 1\n```\n", "does not exist"),
    ("<!-- run by tests/test_durations.py: x -->\n```python\nx = 1\n```\n", "never names"),
    ("- an item: <!-- not run: a fragment -->\n  ```yaml\n  a: 1\n  ```\n", None),
    ("<!-- run by tests/test_docs.py: this module -->\n````markdown\n```python\n```\n````\n", None),
])
def test_the_check_finds_an_unmarked_block_and_a_missing_test(text: str, expected: str | None) -> None:
    page = ROOT / "docs" / "example.md"  # test_docs.py names example.md here, which the last case needs
    (block,) = blocks(page, text)
    found = problems(block)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def _two_commands(page: Path) -> list[str]:
    block = next(b for b in blocks(page) if b.info == "bash")
    return [line.split("#")[0].strip() for line in block.body.splitlines() if line.split("#")[0].strip()]


def test_the_two_commands_are_make_demo_and_make_test() -> None:
    """The README's first block, and the getting-started page's, are exactly the two commands, and the Makefile
    has both targets: demo runs the main job, test the suite."""
    assert _two_commands(ROOT / "README.md") == TWO_COMMANDS
    assert _two_commands(ROOT / "docs" / "getting-started.md") == TWO_COMMANDS
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(PY\) jobs/demo\.py$", makefile, re.M)

    def runs(target: str) -> set[str]:
        """The targets the recipe of ``target`` makes, and theirs (a pattern rule's target has none here)."""
        recipe = re.search(rf"^{re.escape(target)}:.*\n((\t.*\n)*)", makefile, re.M)
        if not recipe:
            return set()
        named = set(re.findall(r"\$\(MAKE\)[^;]*?((?: [a-z][\w.-]*)+)(?:;|$)", recipe.group(1), re.M))
        made = {word for words in named for word in words.split()}
        return made | {deeper for word in made for deeper in runs(word)}

    assert {"docs", "typecheck", "test-no-spark", "test-spark", "test-spark-versions"} <= runs("test")
    for part in ("test-no-spark", "test-spark"):
        assert re.search(rf"^{part}: .*\n(\t.*\n)*\t\$\(PY\) -m pytest ", makefile, re.M), part


def test_make_install_makes_the_environment_the_two_commands_use_and_the_manual_says_so() -> None:
    """A newcomer's install step: `make install` makes .venv as `make demo` does (the same prerequisite, nothing
    run), and getting started shows it next to the editable pip install."""
    makefile = (ROOT / "Makefile").read_text()
    install = re.search(r"^install: (.*)\n((?:\t.*\n)*)", makefile, re.M)
    demo = re.search(r"^demo: (.*)$", makefile, re.M)
    assert install and demo and install.group(1) == demo.group(1) == "$(VENV)/.installed"
    assert "$(PY)" not in install.group(2) and "install" in re.search(r"^\.PHONY: (.*)$", makefile, re.M).group(1).split()
    block = next(b for b in blocks(ROOT / "docs" / "getting-started.md") if "make install" in b.body)
    commands = [line.split("#")[0].strip() for line in block.body.splitlines()]
    assert commands == ["make install", "pip install -e '.[emulator,spark]'"]


def test_the_first_pipeline_is_the_same_in_the_readme_and_the_manual() -> None:
    def first(page: Path) -> str:
        return next(b.body for b in blocks(page) if "the first pipeline" in b.mark)

    assert first(ROOT / "README.md") == first(ROOT / "docs" / "getting-started.md")


def test_the_readme_is_a_front_page() -> None:
    """At most about 250 lines, and every page it links to exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and not [link for link in links if not (ROOT / link).is_file()]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower().replace("`", ""))


def repeated_headings(page: Path, text: str | None = None) -> list[str]:
    """Sections whose first paragraph opens with their heading again, in bold (``## Foo`` then ``**Foo.** ...``)."""
    lines = (page.read_text() if text is None else text).splitlines()
    found = []
    for i, line in enumerate(lines):
        heading = re.match(r"#{1,6} (.+)$", line)
        if not heading:
            continue
        following = next((later for later in lines[i + 1:] if later.strip()), "")
        bold = re.match(r"\*\*(.+?)\*\*", following)
        if bold:
            title, opening = _words(heading.group(1)), _words(bold.group(1))
            if title and opening and (opening[:len(title)] == title or title[:len(opening)] == opening):
                found.append(f"{page.relative_to(ROOT)}:{i + 1}: '{heading.group(1)}' is repeated in bold")
    return found


def test_no_section_repeats_its_heading_in_bold() -> None:
    assert repeated_headings(ROOT / "docs" / "x.md", "## A blip\n\n**A blip does not stop a query** (both)\n")
    assert repeated_headings(ROOT / "docs" / "x.md", "### Far namespaces\n\n**Far namespaces** (bench)\n")
    assert not repeated_headings(ROOT / "docs" / "x.md", "# The guarantee\n\n**No row is lost.** Every row\n")
    found = [problem for page in PAGES for problem in repeated_headings(page)]
    assert not found, "\n".join(found)


def test_the_pages_import_config_options_from_its_public_module() -> None:
    """spark_sb.source re-exports config_options; the manual names one module for it: spark_sb.options, whose
    entry is on the configuration reference page."""
    imports = [(block.where, match.group(1)) for block in all_blocks()
               for match in re.finditer(r"^from (spark_sb[\w.]*) import [^\n]*\bconfig_options\b", block.body, re.M)]
    assert imports and {module for _, module in imports} == {"spark_sb.options"}, imports
    # in prose too (the syphon page named spark_sb.source.config_options), and in the error that points at it
    named = [str(page.relative_to(ROOT)) for page in PAGES if "spark_sb.source.config_options" in page.read_text()]
    assert not named, named
    assert "spark_sb.source.config_options" not in (ROOT / "spark_sb" / "options.py").read_text()
    assert "::: spark_sb.options.config_options" in (ROOT / "docs" / "reference" / "configuration.md").read_text()


#: a file named in backticks, as a page points at one: `conf/local.yaml`, `tests/spark/test_readme.py`
NAMED_FILE = re.compile(r"`([\w./-]+\.(?:md|py|yaml|yml|toml|json|java|js|ini|cfg))`")
#: what pages name that is not in the repository, on purpose: the SDK's own module, files a tool writes
OUTSIDE = ("_pyamqp/", ".databricks/", "data/", "/")


def named_files(page: Path) -> list[tuple[str, str]]:
    """The files ``page`` names in backticks that the repository does not have (a bare test module's name is
    looked for under tests/)."""
    missing = []
    for match in NAMED_FILE.finditer(page.read_text()):
        name = match.group(1)
        if name.startswith(OUTSIDE) or ("/" not in name and not name.startswith("test_")):
            continue
        found = (ROOT / name).exists() or (page.parent / name).exists() or (
            "/" not in name and any((ROOT / "tests").rglob(name)))
        if not found:
            missing.append((str(page.relative_to(ROOT)), name))
    return missing


def test_every_file_a_page_names_exists() -> None:
    """The paired sender's page called `shared/design/behaviour.md` its contract: no such file ships (issue 46's
    walk)."""
    found = [missing for page in PAGES for missing in named_files(page)]
    assert not found, found
