"""docs/reliability.md is generated from the tests' reliability markers and must be current."""

from tests.e2e import reliability_doc


def test_docs_reliability_is_generated_from_the_tests():
    rows = reliability_doc.collect()
    assert len(rows) >= 50 and {r.section for r in rows} == set(reliability_doc.SECTIONS)
    for row in rows:  # every row names a test that exists and what it checks
        assert row.input and row.behaviour and "::test_" in row.test
    assert reliability_doc.DOC.read_text() == reliability_doc.render(rows), (
        "docs/reliability.md is out of date: run python -m tests.e2e.reliability_doc"
    )
