"""The README stays a newcomer's page, no link of the docs points nowhere, and every
install line works from a clone.

The docs site itself is built by ``mkdocs build --strict`` in CI (``.ci/run``),
not here: these checks need nothing beyond the standard library.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

MAX_README_LINES = 330
MNIST_COMMAND = ('python3 -m venv .venv && . .venv/bin/activate && pip install ".[tf-cpu,mpich]" '
                 "&& kdrun -np 2 python examples/mnist/train.py")
TEST_MARKER = "<!-- test-command -->"

# [text](target) and ![alt](target), the target up to a space or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~)")


def _markdown_files():
    return [README, *sorted(DOCS.rglob("*.md"))]


def _links(path):
    """Every link target of a Markdown file, outside fenced code blocks and code spans."""
    targets = []
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            in_fence = not in_fence
            continue
        if not in_fence:
            targets += _LINK.findall(re.sub(r"`[^`]*`", "", line))
    return targets


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md must have at most {MAX_README_LINES} lines (move the rest to docs/). "
        f"Received: {len(lines)} lines")


def test_readme_keeps_the_two_fresh_machine_commands():
    text = README.read_text(encoding="utf-8")
    assert MNIST_COMMAND in text, "README.md lost the MNIST command for a fresh machine"
    assert text.count(TEST_MARKER) == 1, f"README.md must hold {TEST_MARKER!r} exactly once"
    after = text.split(TEST_MARKER, 1)[1]
    # .ci/run takes the first ```bash block after the marker, verbatim.
    block = re.search(r"^```bash\n(.*?)^```$", after, flags=re.M | re.S)
    assert block is not None, f"no ```bash block after {TEST_MARKER!r} in README.md"
    assert "pytest" in block[1] and "pip install" in block[1], block[1]


def test_docs_exist():
    assert (DOCS / "index.md").is_file()
    assert (DOCS / "performance.md").is_file()
    assert (ROOT / "mkdocs.yml").is_file()


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_that_exist(path):
    missing = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor in the same page
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        if not (path.parent / file_part).exists():
            missing.append(target)
    assert not missing, f"{path.relative_to(ROOT)} links to files that do not exist: {missing}"


# A pip install's arguments: up to the end of its command (&&, ;, |, a comment, a code span).
_PIP_INSTALL = re.compile(r"pip3? install\b([^\n`&;|#]*)")
# keras-dist or keras_dist as a requirement (extras, a version): a name on a package
# index, where the project is not published (a clone installs itself as ".[extras]").
_FROM_INDEX = re.compile(r"^keras[-_]dist(\[[^\]]*\])?([<>=!~].*)?$", re.IGNORECASE)


def _installs_from_an_index(line):
    return any(_FROM_INDEX.match(argument.strip("\"'"))
               for arguments in _PIP_INSTALL.findall(line) for argument in arguments.split())


def test_an_install_from_an_index_is_recognised():
    assert _installs_from_an_index('pip install "keras-dist[ray]"  # Ray')
    assert _installs_from_an_index("pip install -U keras_dist==0.1 && kdrun")
    assert not _installs_from_an_index('pip install ".[ray,mpich]"  # from a clone of keras_dist')
    assert not _installs_from_an_index("pip install -e . && pytest tests/keras_dist")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_install_lines_install_from_the_clone(path):
    lines = [f"{number}: {line.strip()}"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if _installs_from_an_index(line)]
    assert not lines, (
        f"{path.relative_to(ROOT)} installs keras-dist from a package index, where it is not "
        f'published: install the clone with pip install ".[extras]". Received: {lines}')


# A message or help text telling a user to install keras-dist with extras from an index
# (the pip install may be on the line before, in a string cut in two).
_EXTRA_FROM_INDEX = re.compile(r"pip3? install[^\n]*?\bkeras[-_]dist\[|[\"'`]keras-dist\[")


def _python_sources():
    return [path for folder in ("keras_dist", "tests", "benchmarks", "examples")
            for path in sorted((ROOT / folder).rglob("*.py"))]


def test_messages_and_help_name_installs_that_work():
    lines = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in _python_sources() if path != pathlib.Path(__file__).resolve()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if _EXTRA_FROM_INDEX.search(line)]
    assert not lines, (
        "an error message or help text installs keras-dist from a package index, where it is "
        'not published: name the clone\'s extra (pip install ".[extra]" from a clone) or the '
        f"packages themselves. Received: {lines}")
