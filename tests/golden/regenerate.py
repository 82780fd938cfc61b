"""Rewrite the golden translations after an intended change: python tests/golden/regenerate.py; review the diff."""
import json
from pathlib import Path

from fp8dist.config.load import load_config
from fp8dist.translate import TARGETS

ROOT = Path(__file__).resolve().parents[2]
# MS-AMP configs are translated for MS-AMP 0.4's pinned DeepSpeed; the rest for the newest known.
DEEPSPEED_VERSION = {"msamp": "0.13.1"}


def golden_cases():
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        spec = load_config(config)
        version = DEEPSPEED_VERSION.get(spec.fp8.backend, "0.19.8") if spec.engine == "deepspeed" else None
        yield config, spec, spec.engine, version


def translate(spec, target, version):
    document = TARGETS[target](spec, deepspeed_version=version)
    if target == "fsdp2" and document["float8"] and "torchao_version" in document["float8"]:
        for key in ("torchao_version", "torchao_version_origin"):  # the installed torchao, not the config
            document["float8"].pop(key)
    return document


if __name__ == "__main__":
    for config, spec, target, version in golden_cases():
        path = ROOT / "tests" / "golden" / f"{config.stem}.{target}.json"
        path.write_text(json.dumps(translate(spec, target, version), indent=2) + "\n")
        print("wrote", path.relative_to(ROOT))
