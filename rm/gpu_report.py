"""What this machine has, and which memory profiles of a config fit on it.

    python -m rm.gpu_report [the same overrides as rm.train]

Replaces the hand-written GPU check scripts: devices with total and free memory, then the
pre-flight estimate of every memory profile for the composed config on the detected hardware.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from rm.foundations.config import compose, memory_profiles, to_run_config
from rm.foundations.errors import boundary, run_hydra_app
from rm.memory.terms import GIB, estimate_run
from rm.foundations.hardware import host_ram_gib, resolve_hardware
from rm.settings.validate import ConfigError, resolve_world_size, validate


def device_lines() -> list:
    import torch  # here, so that --help answers without loading it

    if not torch.cuda.is_available():
        return [f"no CUDA device; CPU with {host_ram_gib():.1f} GiB RAM"]
    lines = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        lines.append(f"cuda:{i} {props.name}: {total / GIB:.2f} GiB total, {free / GIB:.2f} GiB free, "
                     f"compute capability {props.major}.{props.minor}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    return lines


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    with boundary():
        print_report(raw)
    sys.exit(0)


def print_report(raw: DictConfig) -> None:
    print("\n".join(device_lines()))
    base = to_run_config(raw)
    hardware = resolve_hardware(base.hardware)  # for the heading; validate resolves it again for each profile
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("memory_profile=")]
    world, source, _ = resolve_world_size(base.distributed, launched=False)  # counted as rm.estimate and rm.train count them
    print(f"\nmodel={base.model.name}, {world} process(es) ({source}), {hardware.device_memory_gib} GiB per device ({hardware.name})")
    errors = []
    profiles = [profile.name for profile in memory_profiles()]  # the running app's config search path
    for profile in profiles:
        cfg = compose([*overrides, f"memory_profile={profile}"])
        try:
            est = estimate_run(cfg, validate(cfg, world, source))
        except ConfigError as err:
            errors.append(err)
            print(f"  {profile:<8} cannot run here: {str(err).splitlines()[-1].strip(' -')}")
            continue
        verdict = "fits" if est.fits else "does not fit"
        print(f"  {profile:<8} peak {est.peak_bytes / GIB:7.2f} GiB ({est.peak_phase}): {verdict}")
    if len(errors) == len(profiles):  # not a fact about this machine: the config itself is invalid (exit 2)
        raise ConfigError(f"no memory profile can run this config; with memory_profile={profiles[0]}: {errors[0]}")


if __name__ == "__main__":
    from rm.foundations.cli import help_page, without_bitsandbytes, without_run_dir

    without_run_dir()  # it only prints: no outputs/<date>/<time>/ unless hydra.run.dir is given
    without_bitsandbytes()
    help_page("gpu_report")
    run_hydra_app(main)
