"""Collection settings for ``python -m pytest`` (testpaths: tests/ and rm/ for the doctests)."""

# The doctests import every module of rm/, and importing rm.plan.warm is its whole job: it marks bitsandbytes as not
# importable (rm.foundations.cli.without_bitsandbytes) in the forkserver it preloads. Imported into the test process, it would
# skip every bitsandbytes test that runs after collection.
collect_ignore = ["rm/plan/warm.py"]
