"""fp8dist: one precision config for DeepSpeed and FSDP2, with FP8 and a dtype audit.

Importing fp8dist imports neither torch nor DeepSpeed; the runtimes import them when used. It does filter the
libraries' known-benign start-up messages (fp8dist.library_noise), so importing it first keeps them out.

This module is also the composition root: it hands the first-step audit and precision.fp8.policy auto's
calibration (fp8dist.audit, a layer above the engines) to the engines, which never import it, and the recognition
of other tools' files (fp8dist.formats) to the config loader (docs/architecture.md).
"""
from typing import TYPE_CHECKING

from fp8dist import library_noise
from fp8dist.config.arguments import add_config_arguments, spec_from_args
from fp8dist.config.load import load_config, provide_other_tool
from fp8dist.config.spec import Spec
from fp8dist.engines.base import provide_calibration, provide_first_step_audit
from fp8dist.errors import ConfigError, ExitCode, Fp8distError, UnsupportedEnvironment

if TYPE_CHECKING:
    from fp8dist.translate import EnginePlan

__version__ = "0.1.0"
__all__ = ["load_config", "load_model", "Spec", "ConfigError", "ExitCode", "Fp8distError", "UnsupportedEnvironment",
           "add_config_arguments", "spec_from_args", "__version__"]


def load_model(name_or_dir: str, spec: Spec, *, plan: "EnginePlan | None" = None):
    """MODEL as a run of `spec` needs it, returned as a fp8dist.runtime.models.LoadedModel (`.model` for the engine
    setup, `.materialize` for fp8dist.engines.fsdp2.prepare, `.make_batch`): RAM-efficiently where
    `parallel.cpu_ram_efficient_loading` says so (a local Hugging Face directory only), else fully on every rank.
    MODEL: a built-in name, a local Hugging Face model directory, or `package.module:factory`. `plan`: the run's
    translation when the caller made it already. Under DeepSpeed ZeRO-3 RAM-efficient loading, keep the returned
    object alive as long as the model (it holds the HfDeepSpeedConfig)."""
    from fp8dist.runtime.loading import load_for_run

    return load_for_run(name_or_dir, spec, plan=plan)


def _first_step_audit(engine, mode: str):
    from fp8dist.audit.first_step import first_step_audit

    return first_step_audit(engine, mode)


def _calibrate(spec, model, steps, gpu, rank):
    import os
    import sys

    from fp8dist.audit.calibration import calibrated_spec
    from fp8dist.runtime.ranks import JOB_ENV, PROGRESS, emit

    def say(text: str) -> None:
        """On stderr; in the ranks of a CLI command (`audit`, `compare`: fp8dist.runtime.ranks.launch) as a progress
        line, which the command shows on its stderr (the ranks' own output is kept for errors only)."""
        if os.environ.get(JOB_ENV):
            emit(PROGRESS, "calibration", text)
        else:
            print(text, file=sys.stderr, flush=True)

    return calibrated_spec(spec, model, steps, gpu, rank, say)


def _other_tool(document, source: str):
    from fp8dist.formats.importing import other_tool_issue

    return other_tool_issue(document, source)


provide_first_step_audit(_first_step_audit)
provide_calibration(_calibrate)
provide_other_tool(_other_tool)
library_noise.install()
