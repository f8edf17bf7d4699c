"""The pre-flight memory estimate on the command line: what one device will hold at the peak of a step.

    python -m rm.estimate [the same overrides as rm.train]       # a table; exit 3 when it does not fit
    python -m rm.estimate estimate.json=true ...                 # JSON on stdout

The numbers come from :mod:`rm.memory.terms`; this module composes the config, prints the table
(:mod:`rm.memory.report`) and, when the run does not fit, the changes that would (:mod:`rm.memory.suggest`).
"""

from __future__ import annotations

from rm.memory.terms import estimate_run
from rm.memory.report import estimate_label, format_table
from rm.memory.suggest import format_suggestions, suggestions


def main() -> None:
    import json
    import sys

    import hydra
    from hydra.core.hydra_config import HydraConfig

    from rm.foundations.cli import help_page, without_bitsandbytes, without_run_dir
    from rm.foundations.config import to_run_config
    from rm.foundations.errors import answer_only_on_stdout, run_hydra_app

    without_run_dir()  # it only prints: no outputs/<date>/<time>/ unless hydra.run.dir is given
    without_bitsandbytes()
    help_page("estimate")

    @hydra.main(config_path="../conf", config_name="config", version_base="1.3")
    def run(raw) -> None:
        with answer_only_on_stdout() as answer:
            from rm.settings.validate import resolve_world_size, unused_overrides, validate  # here: `--help` needs no torch

            cfg = to_run_config(raw)
            plan = validate(cfg, *resolve_world_size(cfg.distributed, launched=False))
            est = estimate_run(cfg, plan)
            overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("estimate.")]
            est.warnings += unused_overrides(cfg.memory_profile, overrides)
            if cfg.estimate.json:
                text = json.dumps(est.to_dict(), indent=2)
            else:
                text = format_table(est, estimate_label(cfg.model, cfg.memory_profile, plan))
                if not est.fits:
                    text += "\n" + format_suggestions(suggestions(overrides, cfg, plan))
        print(text, file=answer)
        sys.exit(0 if est.fits else 3)

    run_hydra_app(run)


if __name__ == "__main__":
    main()
