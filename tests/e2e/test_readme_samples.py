"""README.md's sample outputs are rendered from what the code prints (tests/e2e/readme_samples.py) and must be current."""

from tests.e2e import readme_samples


def test_readme_sample_outputs_are_what_the_code_prints():
    record = readme_samples.load_record()
    assert {"demo", "sweep"} <= record.keys(), "benchmarks/results/readme_samples.json lacks a recorded demo or sweep"
    text = readme_samples.README.read_text()
    assert text == readme_samples.rewrite(text, readme_samples.render_all(record)), (
        "README.md's sample outputs are out of date: run python -m tests.e2e.readme_samples"
    )


def test_every_output_block_of_the_readme_is_a_generated_sample():
    """A code block that shows program output (a `$ ` prompt, a log line, a table) must sit in a sample region;
    commands and snippets for the reader to copy need not."""
    text = readme_samples.README.read_text()
    outside = readme_samples.REGION.sub("", text)
    blocks = [b for b in outside.split("```")[1::2]]
    output_like = [b for b in blocks if not b.startswith(("bash", "python"))]
    # The layout tree (README, Architecture) is the only plain block that is not program output.
    assert [b.split("\n", 2)[1] for b in output_like] == ["conf/        Hydra config groups"], output_like
