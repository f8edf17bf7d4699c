"""mkdocs hook: the measurement records of ``benchmarks/results/`` join the site under ``records/``.

The guides link a record as ``../benchmarks/results/NAME``, a path that works on GitHub and in an editor; mkdocs
only knows files under ``docs/``, so this hook adds each record to the site's files and rewrites those links to
where the record now is on the site. ``mkdocs build --strict`` then checks every such link like any other: a
record that moves or leaves the tree breaks the build.
"""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
LINK = "](../benchmarks/results/"
GUIDE = "](../../docs/"  # a record's link to a guide, from benchmarks/results/


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            files.append(File.generated(config, "records/" + path.relative_to(RESULTS).as_posix(),
                                        abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    up = "../" * page.file.src_uri.count("/")  # a page under docs/<folder>/ sits one level deeper
    if page.file.src_uri.startswith("records/"):
        # A record in a folder of benchmarks/results/ reaches docs/ one level further up than on the site.
        return markdown.replace("../" * (page.file.src_uri.count("/") - 1) + GUIDE[2:], up)
    return markdown.replace(LINK, "](" + up + "records/")
