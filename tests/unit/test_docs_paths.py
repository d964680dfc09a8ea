"""Every path of this repository that README.md and docs/*.md name exists, so that the docs do not send a reader to
code, tests or results that have moved or gone.

What is checked: each path in backticks, in a link or in the prose whose first folder is one of the repository's
own (engine/, console/, pages/, tests/, bench/, docs/, .ci/), as a file or folder from the repository's root (a
link from the file's own folder); ``{a,b}`` in a path is each of its forms, and a glob must match something; each
``python -m MODULE`` of this repository's packages, as a module file or package folder; and each
``python -m bench SCENARIO``, as a scenario of bench/scenarios. What is not: URLs, absolute paths (/proc/..., /tmp/...),
variables ($OUT/...), placeholders (<name>, PATH, DATE-PROFILE, ...), paths outside the repository (../shared/...),
vLLM's or other packages' own files (vllm/config/vllm.py), folders made at run time or ignored by git (data/,
tests/artifacts/), files of git history (``git show fce10cb:docs/...``), and paths in fenced code blocks (examples
and output), where only ``python -m`` modules are checked. All missing paths are reported at once.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.scenarios import SCENARIOS

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("engine", "console", "pages", "tests", "bench", "docs", ".ci")
UNTRACKED = ("data/", "tests/artifacts")  # made at run time, or ignored by git: not in a fresh clone
PACKAGES = ("engine", "console", "pages", "bench")
CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)
HISTORY = re.compile(r"\b[0-9a-f]{7,40}:\S+")  # git show COMMIT:PATH names a file of git history
MODULE = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)(?:\s+([a-z][\w-]*))?")
PROSE = re.compile(r"(?<![\w./$~-])((?:engine|console|pages|tests|bench|docs|\.ci)/[\w./{},*-]*)")
PLACEHOLDER = re.compile(r"[<>…]|\.\.\.|(?:^|/)[A-Z][A-Z0-9]*(?:[_-][A-Z0-9]+)*(?:/|$)")
EDGES = "\"'()[],;:!?*"  # and Markdown's emphasis


def expand(path: str) -> list[str]:
    """``a{1,2}b`` as ``a1b`` and ``a2b`` (shell brace expansion, nested or several)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    return [p for alt in m[1].split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]


def clean(token: str) -> str:
    """A token of a code span or the prose without what surrounds a path: quotes, brackets, punctuation, an
    option's name (``--out=DIR``), a line number (``x.py:42``), a test's name (``x.py::test``), an anchor."""
    token = token.split("=", 1)[1] if "=" in token and not token.startswith("{") else token
    token = token.strip(EDGES).rstrip(".")
    token = token.split("::", 1)[0].split("#", 1)[0]
    return re.sub(r":\d+$", "", token).strip(EDGES)


def is_repo_path(token: str) -> bool:
    first = token.split("/", 1)[0]
    return ("/" in token and first in ROOTS and not token.startswith(UNTRACKED)
            and PLACEHOLDER.search(token) is None)


def exists(path: str, base: Path = REPO) -> bool:
    if "*" in path or "?" in path:
        try:
            return any(base.glob(path))
        except ValueError:  # not a pattern pathlib takes
            return False
    return (base / path).exists()


def module_exists(name: str) -> bool:
    path = REPO / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() or (path / "__main__.py").is_file()


def paragraphs(text: str) -> list[tuple[list[tuple[int, str]], bool]]:
    """The lines of ``text`` (numbered) in paragraphs, as Markdown joins them (a code span may go on to the next
    line), and whether each is a fenced code block."""
    out: list[tuple[list[tuple[int, str]], bool]] = []
    block: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            if block:
                out.append((block, fenced))
            block, fenced = [], not fenced
        elif not line.strip() and not fenced:
            if block:
                out.append((block, fenced))
            block = []
        else:
            block.append((number, line))
    if block:
        out.append((block, fenced))
    return out


def missing_in(text: str, name: str, folder: Path) -> list[str]:
    """What ``text`` (the document ``name``, in ``folder``: its links' base) names of this repository that is not
    there, as ``name:line: what``."""
    out: list[str] = []
    for block, fenced in paragraphs(text):

        def where(what: str, block: list[tuple[int, str]] = block) -> str:
            line = next((n for n, text in block if what in text), block[0][0])
            return f"{name}:{line}"

        joined = URL.sub(" ", HISTORY.sub(" ", " ".join(line for _, line in block)))
        for m in MODULE.finditer(joined):  # in code blocks too: a command names its module exactly
            module, word = m[1], m[2]
            if module.split(".", 1)[0] in PACKAGES and not module_exists(module):
                out.append(f"{where(module)}: module {module}")
            if module == "bench" and word and word not in SCENARIOS and word != "help":
                out.append(f"{where(word)}: bench scenario {word}")
        if fenced:
            continue
        tokens = [clean(t) for span in CODE.findall(joined) for t in span.split()]
        tokens += [clean(m) for m in PROSE.findall(LINK.sub(" ", CODE.sub(" ", joined)))]
        for token in tokens:
            if is_repo_path(token):
                out += [f"{where(token)}: {p}" for p in expand(token) if not exists(p)]
        for target in LINK.findall(joined):
            if URL.match(target) or target.startswith(("#", "mailto:", "/")):
                continue
            target = target.split("#", 1)[0]
            if target and PLACEHOLDER.search(target) is None and not exists(target, folder):
                out.append(f"{where(target)}: link {target}")
    return out


def test_every_path_the_docs_name_exists() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    missing = [m for doc in docs for m in missing_in(doc.read_text(), str(doc.relative_to(REPO)), doc.parent)]
    assert not missing, f"{len(missing)} paths named in the docs do not exist:\n" + "\n".join(missing)


def test_the_extraction_takes_paths_and_leaves_the_rest() -> None:
    """The rules above on made-up lines: what counts as a path of this repository, and what does not."""
    lines = ["`engine/no_such_module.py` and `tests/none/` and [x](no-such-page.md) and bench/nothing/here.", "",
             "`python -m engine.no_such` `python -m bench no-such-scenario` `docs/x-{1,2}.json` `bench/*.nope`", "",
             "`/proc/1/stat` `$OUT/x/y` `../shared/gpu/logs` `vllm/config/vllm.py` `data/models/demo`",
             "`git show fce10cb:docs/gone.json` <https://example.com/engine/x.py> `bench/results/DATE-PROFILE/`",
             "`llmops-agent-<node>` `tests/artifacts/shots/` `docs/PATH` `engine/serving/controller.py:62`", "",
             "a span that goes on: `python -m bench also-none --profile h200", "--out tests/gone/` and on", "",
             "```", "docs/in-a-fence.md `python -m console.no_such`", "```"]
    found = [m.split(": ", 1)[1] for m in missing_in("\n".join(lines), "probe.md", REPO / "docs")]
    assert found == ["engine/no_such_module.py", "tests/none/", "bench/nothing/here", "link no-such-page.md",
                     "module engine.no_such", "bench scenario no-such-scenario", "docs/x-1.json", "docs/x-2.json",
                     "bench/*.nope", "bench scenario also-none", "tests/gone/", "module console.no_such"]
