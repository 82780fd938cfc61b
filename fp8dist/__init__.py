"""fp8dist: one precision config for DeepSpeed and FSDP2, with FP8 and a dtype audit.

Importing fp8dist imports neither torch nor DeepSpeed; the runtimes import them when used.
"""
from fp8dist.config.load import load_config
from fp8dist.config.spec import Spec
from fp8dist.errors import ConfigError, Fp8distError, UnsupportedEnvironment
from fp8dist.launch_args import add_config_arguments, spec_from_args

__version__ = "0.1.0"
__all__ = ["load_config", "Spec", "ConfigError", "Fp8distError", "UnsupportedEnvironment",
           "add_config_arguments", "spec_from_args", "__version__"]
