"""Rewrite the golden translations after an intended change: python tests/golden/regenerate.py; review the diff."""
import json
from pathlib import Path

from fp8dist.config.load import load_config
from fp8dist.translate import to_deepspeed, to_fsdp2

ROOT = Path(__file__).resolve().parents[2]
# Goldens pin the versions they were made for, so they hold whatever torchao/DeepSpeed/TE is installed
# (tests/unit/translate/test_translate.py covers the "installed version" resolution separately). MS-AMP configs are
# translated for MS-AMP 0.4's pinned DeepSpeed; the rest for the newest known.
DEEPSPEED_VERSION = {"msamp": "0.13.1"}
DEFAULT_DEEPSPEED_VERSION = "0.19.8"
TORCHAO_VERSION = "0.18.0"
TE_VERSION = "2.20.2"


def golden_cases():
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        spec = load_config(config)
        if spec.engine == "deepspeed":
            version = DEEPSPEED_VERSION.get(spec.fp8.backend, DEFAULT_DEEPSPEED_VERSION)
        else:
            version = TORCHAO_VERSION
        yield config, spec, spec.engine, version


def translate(spec, target, version):
    if target == "deepspeed":
        return to_deepspeed(spec, deepspeed_version=version)
    return to_fsdp2(spec, torchao_version=version, te_version=TE_VERSION).to_json()


if __name__ == "__main__":
    for config, spec, target, version in golden_cases():
        path = ROOT / "tests" / "golden" / f"{config.stem}.{target}.json"
        path.write_text(json.dumps(translate(spec, target, version), indent=2) + "\n")
        print("wrote", path.relative_to(ROOT))
