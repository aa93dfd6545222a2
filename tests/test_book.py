"""The course as a book (scripts/build_book.py): pages, the table of contents, the link check.

`make test` builds the real book from its own run of the notebooks and fails on any problem;
these tests hold the builder to what it must catch, on small notebooks made here, and build the
real course's pages (without outputs) to check its README and its links.
"""

import re

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from scripts import build_book

README = """# A course

## The course

| notebook | what |
| --- | --- |
| `00_first` | one |
| `01_second` | two |
"""


def executed(title: str, *markdown: str, outputs=None, ran: bool = True):
    """A notebook as nbval's run leaves it: a heading, Markdown cells, one code cell."""
    code = new_code_cell("print(1)", execution_count=1 if ran else None,
                         outputs=outputs if outputs is not None else
                         [new_output("stream", name="stdout", text="1\n")])
    return new_notebook(cells=[new_markdown_cell(f"# {title}\n\ntext"),
                               *map(new_markdown_cell, markdown), code])


def course(tmp_path, first=None, second=None, readme=README):
    """notebooks/ (as committed), executed/ (as run) and a README; returns the build's
    problems and the site's folder."""
    nbs, run, site = tmp_path / "notebooks", tmp_path / "executed", tmp_path / "site"
    nbs.mkdir()
    run.mkdir()
    books = {"00_first": first or executed("00 · First", "See [the next](01_second.ipynb)."),
             "01_second": second or executed("01 · Second", "Back to [the top](#01-·-Second).")}
    for name, nb in books.items():
        nbformat.write(new_notebook(cells=[new_markdown_cell("# x")]), nbs / f"{name}.ipynb")
        nbformat.write(nb, run / f"{name}.ipynb")
    (tmp_path / "README.md").write_text(readme)
    return build_book.build(run, site, nbs, tmp_path / "README.md"), site


def test_a_complete_book_has_every_page_in_order_and_no_problem(tmp_path):
    problems, site = course(tmp_path)
    assert problems == [], "a complete course must build without a problem:\n" + \
        "\n".join(problems)
    assert sorted(p.name for p in site.glob("*.html")) == \
        ["00_first.html", "01_second.html", "index.html"]
    front = (site / "index.html").read_text()
    toc = re.search(r'<nav class="book-toc">(.*?)</nav>', front).group(1)
    assert re.findall(r'href="(\d\d_\w+)\.html"', toc) == ["00_first", "01_second"], \
        "the table of contents must list the chapters in the course's order"
    assert '<a href="01_second.html"><code>01_second</code></a>' in front, \
        "the README's course table must link each chapter's page"
    first = (site / "00_first.html").read_text()
    assert 'href="01_second.html"' in first, "a link to a chapter's .ipynb must go to its page"
    assert "<title>00 · First</title>" in first


def test_a_broken_link_is_named_with_its_page(tmp_path):
    problems, _ = course(tmp_path, first=executed("00 · First", "[gone](missing.html)"))
    assert problems == ["broken link: 00_first.html: missing.html (no such file in the book)"]


def test_a_missing_anchor_is_named(tmp_path):
    problems, _ = course(tmp_path, second=executed("01 · Second", "[here](00_first.ipynb#nope)"))
    assert problems == ["broken link: 01_second.html: 00_first.html#nope "
                        "(no anchor #nope on that page)"]


def test_a_link_out_of_the_book_is_broken(tmp_path):
    (tmp_path / "outside.html").write_text("<p>not in the site</p>")
    problems, _ = course(tmp_path, first=executed("00 · First", "[out](../outside.html)"))
    assert problems == ["broken link: 00_first.html: ../outside.html (no such file in the book)"]


def test_a_cell_that_did_not_run_raised_or_warned_is_named(tmp_path):
    error = new_output("error", ename="AssertionError", evalue="the claim failed", traceback=[])
    warned = new_output("stream", name="stderr",
                        text="x.py:3: UserWarning: this page shows a warning\n  warn()\n")
    problems, _ = course(tmp_path, first=executed("00 · First", ran=False),
                         second=executed("01 · Second", outputs=[error, warned]))
    assert problems == [
        "00_first.ipynb: code cell 1 of 1 did not run (its notebook run stopped before it?)",
        "01_second.ipynb: code cell 1 of 1 raised AssertionError: the claim failed",
        "01_second.ipynb: code cell 1 of 1 shows a warning: "
        "x.py:3: UserWarning: this page shows a warning",
    ]


def test_a_chapter_without_its_run_or_missing_from_the_readme_is_named(tmp_path):
    problems, site = course(tmp_path, readme=README.replace("| `01_second` | two |\n", ""))
    assert problems == ["README.md's course table lists ['00_first']; the course has "
                        "['00_first', '01_second'] (notebooks/NN_*.ipynb, in that order)"]
    (tmp_path / "executed" / "01_second.ipynb").unlink()
    problems = build_book.build(tmp_path / "executed", site, tmp_path / "notebooks",
                                tmp_path / "README.md")
    assert problems[0].startswith("01_second.ipynb: no executed copy in ")
    assert "broken link: 00_first.html: 01_second.html (no such file in the book)" in problems


def test_the_real_course_builds_with_every_link_resolving(tmp_path):
    """The committed notebooks (no outputs: their cells 'did not run', nothing else) and the
    real README: every chapter's page, the course's order, every internal link."""
    root = build_book.ROOT
    problems = build_book.build(root / "notebooks", tmp_path, root / "notebooks",
                                root / "README.md")
    other = [p for p in problems if "did not run" not in p]
    assert other == [], "the course's book has problems:\n" + "\n".join(other)
    names = [p.stem for p in build_book.course_order(root / "notebooks")]
    assert names and names == sorted(names)
    assert sorted(p.stem for p in tmp_path.glob("*.html")) == sorted([*names, "index"])
    toc = re.search(r'<nav class="book-toc">(.*?)</nav>',
                    (tmp_path / "index.html").read_text()).group(1)
    assert re.findall(r'href="(\d\d_\w+)\.html"', toc) == names
