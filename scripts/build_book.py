"""The course as a book: a static HTML site of every notebook as `make test` executed it.

    make book        # runs the notebooks once (LABKIT_QUICK=1), then this script
    python scripts/build_book.py [--executed build/book/executed] [--out build/book/html]

`--executed` holds the notebooks with their outputs, written by nbval's run of them
(`scripts/nbval_capture.py`); this script turns each into a page with nbconvert's `lab`
template (plots embedded in the page, with their alternative text), makes the README the front
page, puts a table of contents in the course's order (the chapters' numbers, 00 to 08) on every
page, and then checks the site. It fails, naming each problem, on:

- a chapter without an executed notebook, a cell that did not run or raised, or an output that
  shows a Python warning;
- any warning while building (Python's warnings module or a logged warning from nbconvert);
- a notebook that the README's course table does not list, or lists out of order;
- an internal link (`href`, `src`) to a file that is not in the site, or to an anchor that its
  page does not have. Links to other sites are not followed: the check runs offline.

Why nbconvert and not Jupyter Book: Jupyter Book 2 (and MyST, which it runs) fetches its HTML
theme from api.mystmd.org at build time, so it cannot build in a room without internet;
Jupyter Book 1 (Sphinx) is in maintenance only. nbconvert is Jupyter's own converter, already
installed with JupyterLab, and builds offline.
"""

from __future__ import annotations

import argparse
import html
import logging
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
from markdown_it import MarkdownIt
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "book_template"
CHAPTER_FILE = re.compile(r"^(\d\d)_\w+\.ipynb$")
WARNING_SHOWN = re.compile(r"\b\w*Warning: ")  # how Python prints a warning in an output


@dataclass(frozen=True)
class Chapter:
    """One notebook of the course: its name (`03_quantization`) and its first heading."""

    name: str
    title: str

    @property
    def page(self) -> str:
        return f"{self.name}.html"


def course_order(notebooks: Path) -> list[Path]:
    """The course's notebooks (`NN_name.ipynb`), in the course's order: by their number."""
    return sorted(p for p in notebooks.glob("*.ipynb") if CHAPTER_FILE.match(p.name))


def title_of(nb) -> str:
    """A notebook's first Markdown heading, without its `#`s."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "(untitled)"


def run_problems(nb, name: str) -> list[str]:
    """What a reader should not find on a chapter's page: cells that did not run, errors,
    warnings printed in an output."""
    problems = []
    code = [c for c in nb.cells if c.cell_type == "code"]
    for i, cell in enumerate(code, 1):
        where = f"{name}: code cell {i} of {len(code)}"
        if cell.execution_count is None:
            problems.append(f"{where} did not run (its notebook run stopped before it?)")
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                problems.append(f"{where} raised {out.ename}: {out.evalue}")
            text = out.get("text", "") if out.output_type == "stream" else ""
            shown = WARNING_SHOWN.search(text)
            if shown:
                line = text[:shown.end()].splitlines()[-1] + text[shown.end():].split("\n")[0]
                problems.append(f"{where} shows a warning: {line.strip()}")
    return problems


# --- pages -------------------------------------------------------------------------------

STYLE = """
<style>
  nav.book-toc { position: fixed; top: 0; left: 0; bottom: 0; width: 15rem; overflow-y: auto;
    padding: 1rem; background: #f6f6f6; border-right: 1px solid #ddd;
    font: 14px/1.4 system-ui, sans-serif; box-sizing: border-box; }
  nav.book-toc ul { list-style: none; padding-left: 0; } nav.book-toc li { margin: .4rem 0; }
  nav.book-toc a { color: #1a5fb4; text-decoration: none; }
  nav.book-toc .here { font-weight: 600; }
  body { margin-left: 16rem !important; }
  nav.book-pager { display: flex; justify-content: space-between; margin: 2rem 1rem;
    font: 15px system-ui, sans-serif; }
  .book-front { max-width: 52rem; margin: 2rem; font: 16px/1.5 system-ui, sans-serif; }
  .book-front table { border-collapse: collapse; } .book-front pre { background: #f6f6f6;
    padding: .6rem; overflow-x: auto; }
  .book-front td, .book-front th { border: 1px solid #ddd; padding: .3rem .5rem;
    vertical-align: top; }
</style>
"""


def toc(chapters: list[Chapter], here: str) -> str:
    """The table of contents on every page, in the course's order; `here` is marked."""
    def item(href: str, text: str) -> str:
        mark = ' class="here"' if href == here else ""
        return f'<li{mark}><a href="{href}">{html.escape(text)}</a></li>'

    items = "".join(item(c.page, c.title) for c in chapters)
    return (f'<nav class="book-toc"><a href="index.html"><b>labkit</b></a>'
            f"<ul>{items}</ul></nav>")


def pager(chapters: list[Chapter], i: int) -> str:
    """Links to the previous and the next chapter (the front page before the first)."""
    prev = (chapters[i - 1].page, chapters[i - 1].title) if i > 0 else ("index.html", "labkit")
    nxt = (f'<a href="{chapters[i + 1].page}">{html.escape(chapters[i + 1].title)} →</a>'
           if i + 1 < len(chapters) else "<span></span>")
    return (f'<nav class="book-pager"><a href="{prev[0]}">← {html.escape(prev[1])}</a>'
            f"{nxt}</nav>")


def link_notebooks(page: str, chapters: list[Chapter]) -> str:
    """Point links at a chapter's notebook (`03_quantization.ipynb`, `notebooks/...`) to its
    page instead."""
    names = {c.name for c in chapters}

    def fix(m: re.Match) -> str:
        path, frag = m.group(2), m.group(3) or ""
        stem = Path(path).stem
        if path.endswith(".ipynb") and stem in names and "://" not in path:
            return f'{m.group(1)}"{stem}.html{frag}"'
        return m.group(0)

    return re.sub(r'(href=)"([^"#]*)(#[^"]*)?"', fix, page)


def describe_plots(nb, title: str) -> None:
    """Give every plot without one an alternative text (nbconvert warns about each image that
    lacks one): what its cell titles it, and where it stands in the chapter. A notebook gives
    its own with `display(Image(...), metadata={"image/png": {"alt": ...}})`."""
    section = title
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            heads = [ln.lstrip("#").strip() for ln in cell.source.splitlines()
                     if ln.startswith("#")]
            section = heads[-1] if heads else section
            continue
        titles = re.findall(r"(?:title|suptitle|set_title)\(\s*[rf]?[\"']([^\"'{}]+)[\"']",
                            cell.get("source", ""))
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                meta = out.setdefault("metadata", {}).setdefault("image/png", {})
                what = "; ".join(titles) if titles else "a plot"
                meta.setdefault("alt", f"{what} (chapter {title}, section {section})")


def chapter_page(nb, chapters: list[Chapter], i: int) -> str:
    """One chapter, converted by nbconvert (its `lab` template, plots given their alternative
    text: `book_template/`), with the book's navigation."""
    describe_plots(nb, chapters[i].title)
    body, _ = HTMLExporter(template_name="labkit_book",
                           extra_template_basedirs=[str(TEMPLATES)]).from_notebook_node(nb)
    body = body.replace("<title>Notebook</title>",
                        f"<title>{html.escape(chapters[i].title)}</title>", 1)
    body = body.replace("</head>", STYLE + "</head>", 1)
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + toc(chapters, chapters[i].page),
                  body, count=1)
    body = body.replace("</body>", pager(chapters, i) + "</body>", 1)
    return link_notebooks(body, chapters)


def slug(text: str) -> str:
    """A heading's anchor, GitHub-style: `## The course` -> `the-course`."""
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text))


def front_page(readme: str, chapters: list[Chapter]) -> tuple[str, list[str]]:
    """The README as the book's front page: the course table's chapter names become links.
    Returns the page and what is wrong with the table (a chapter missing or out of order)."""
    body = MarkdownIt("commonmark").enable("table").render(readme)
    body = re.sub(r"<(h[1-6])>(.*?)</\1>",
                  lambda m: f'<{m.group(1)} id="{slug(m.group(2))}">{m.group(2)}</{m.group(1)}>',
                  body)
    names = [c.name for c in chapters]
    listed = re.findall(r"<td><code>(\d\d_\w+)</code></td>", body)
    problems = []
    if listed != names:
        problems.append(f"README.md's course table lists {listed or 'no chapter'}; the course "
                        f"has {names} (notebooks/NN_*.ipynb, in that order)")
    body = re.sub(r"<td><code>(\d\d_\w+)</code></td>",
                  lambda m: (f'<td><a href="{m.group(1)}.html"><code>{m.group(1)}</code></a></td>'
                             if m.group(1) in names else m.group(0)), body)
    page = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"/>'
            f"<title>labkit: the course</title>{STYLE}</head><body>"
            f'{toc(chapters, "index.html")}<main class="book-front">{body}</main>'
            f"{pager_front(chapters)}</body></html>\n")
    return link_notebooks(page, chapters), problems


def pager_front(chapters: list[Chapter]) -> str:
    first = chapters[0] if chapters else None
    return ('<nav class="book-pager"><span></span>'
            + (f'<a href="{first.page}">{html.escape(first.title)} →</a>' if first else "")
            + "</nav>")


# --- the link check ----------------------------------------------------------------------

class _Links(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.anchors: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.anchors.add(unquote(a[key]))
        for key in ("href", "src"):
            if a.get(key):
                self.links.append(a[key])


def broken_links(site: Path) -> tuple[list[str], int]:
    """Every internal link of every page that does not resolve: a missing file, a path out of
    the site, or an anchor its page lacks. Returns them and how many internal links it read."""
    parsed = {}
    for page in sorted(site.rglob("*.html")):
        p = _Links()
        p.feed(page.read_text(encoding="utf-8"))
        parsed[page.resolve()] = p
    broken, checked = [], 0
    root = site.resolve()
    for page, p in parsed.items():
        for link in p.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc:  # another site (or data:, mailto:): offline
                continue
            checked += 1
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            where = f"{page.relative_to(root)}: {link}"
            if not target.is_relative_to(root) or not target.exists():
                broken.append(f"{where} (no such file in the book)")
            elif parts.fragment and target.suffix == ".html" and \
                    unquote(parts.fragment) not in parsed[target].anchors:
                broken.append(f"{where} (no anchor #{parts.fragment} on that page)")
    return broken, checked


# --- the build ---------------------------------------------------------------------------

class _Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(f"{record.name}: {record.getMessage()}")


def build(executed: Path, out: Path, notebooks: Path = ROOT / "notebooks",
          readme: Path = ROOT / "README.md") -> list[str]:
    """Build the book from the executed notebooks into `out` (emptied first). Returns every
    problem found (an empty list: the book is complete and every internal link resolves)."""
    sources = course_order(notebooks)
    problems = [] if sources else [f"no notebooks NN_*.ipynb in {notebooks}"]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    logged = _Logged()
    logging.getLogger().addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = {}
            for src in sources:
                run = executed / src.name
                if not run.exists():
                    problems.append(f"{src.name}: no executed copy in {executed} (did its "
                                    "notebook run finish?)")
                    continue
                nb = nbformat.read(run, as_version=4)
                try:
                    nbformat.validate(nb)
                except nbformat.ValidationError as err:
                    problems.append(f"{src.name}: not a valid notebook ({err.message})")
                problems += run_problems(nb, src.name)
                runs[src.stem] = nb
            chapters = [Chapter(s.stem, title_of(runs.get(s.stem) or nbformat.read(s, 4)))
                        for s in sources]
            for i, c in enumerate(chapters):
                if c.name in runs:
                    (out / c.page).write_text(chapter_page(runs[c.name], chapters, i),
                                              encoding="utf-8")
            index, table = front_page(readme.read_text(encoding="utf-8"), chapters)
            (out / "index.html").write_text(index, encoding="utf-8")
            problems += table
        problems += [f"warning while building: {w.category.__name__}: {w.message} "
                     f"({w.filename}:{w.lineno})" for w in caught]
    finally:
        logging.getLogger().removeHandler(logged)
    problems += [f"warning while building: {r}" for r in logged.records]
    broken, _ = broken_links(out)
    return problems + [f"broken link: {b}" for b in broken]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executed", type=Path, default=ROOT / "build/book/executed",
                    help="the notebooks as nbval ran them (scripts/nbval_capture.py)")
    ap.add_argument("--out", type=Path, default=ROOT / "build/book/html")
    args = ap.parse_args(argv)
    problems = build(args.executed, args.out)
    pages = sorted(args.out.glob("*.html"))
    _, checked = broken_links(args.out)
    size = sum(p.stat().st_size for p in pages) / 1e6
    if problems:
        print(f"the book has {len(problems)} problem(s):", *problems, sep="\n  ",
              file=sys.stderr)
        return 1
    print(f"book: {len(pages)} pages ({size:.1f} MB), {checked} internal links, all resolve; "
          f"open {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
