"""mkdocs hook: the measurement records of ``benchmarks/results/`` join the site under ``records/``.

The guides link a record as ``../benchmarks/results/NAME``, a path that works on GitHub and in an editor; mkdocs
only knows files under ``docs/``, so this hook adds each record to the site's files and rewrites those links to
where the record now is on the site. ``mkdocs build --strict`` then checks every such link like any other: a
record that moves or leaves the tree breaks the build.
"""

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RECORD_FROM_GUIDE = "](../benchmarks/results/"  # how a guide in docs/ links a record


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.is_file():
            files.append(File.generated(config, "records/" + path.relative_to(RESULTS).as_posix(),
                                        abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # folders between the site's root and the page
    if page.file.src_uri.startswith("records/"):
        # In the repository a record sits one folder deeper (benchmarks/results/ against records/), and its links to
        # the guides go up to the root and into docs/; on the site the guides are at the root.
        return markdown.replace("](" + "../" * (depth + 1) + "docs/", "](" + "../" * depth)
    return markdown.replace(RECORD_FROM_GUIDE, "](" + "../" * depth + "records/")
