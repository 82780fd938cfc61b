"""DeepSpeed's AutoEP next to the installed transformers: where DeepSpeed's own call into transformers' output-capture
registry fails (the get with a default that transformers 5.24's registry does not take), the run is refused before
any rank starts (fp8dist.runtime.preflight), naming both installed versions and the files; where it works, nothing
is refused. The probe is checked against DeepSpeed's real function, not against a copy of its call."""
import pytest

from fp8dist.config.load import load_config
from fp8dist.engines.deepspeed.engine import autoep_registry_clash, check_environment
from fp8dist.errors import UnsupportedEnvironment
from fp8dist.facts import versions
from fp8dist.runtime.preflight import preflight
from fp8dist.translate.deepspeed import to_deepspeed


def deepspeed_stops_at_the_registry() -> bool:
    """Whether AutoEP's own restore of transformers' registry (deepspeed module_inject/auto_ep_presets/base.py, run
    for every MoE layer it swaps whose router logits transformers records) raises here."""
    import torch
    from deepspeed.module_inject.auto_ep_presets import base
    from transformers.utils import output_capturing

    model = torch.nn.Linear(2, 2)
    try:
        base._install_instance_transformers_output_recorders(model, {str(type(model)): {}}, output_capturing,
                                                             lambda module: 0)
    except TypeError:
        return True
    return False


def test_the_probe_agrees_with_deepspeeds_own_call():
    clash = autoep_registry_clash()
    assert (clash is not None) == deepspeed_stops_at_the_registry(), clash


@pytest.mark.parametrize("check", ["engine", "preflight"])
def test_autoep_is_refused_before_launch_where_deepspeed_would_stop(check):
    spec = load_config({"engine": "deepspeed", "parallel": {"expert_size": 2}})
    run = (lambda: check_environment(spec, to_deepspeed(spec))) if check == "engine" else (lambda: preflight(spec))
    if not deepspeed_stops_at_the_registry():
        run()
        return
    with pytest.raises(UnsupportedEnvironment) as err:
        run()
    message = str(err.value)
    for name, distribution in (("DeepSpeed", "deepspeed"), ("transformers", "transformers")):
        assert f"{name} {versions.installed_version(distribution)} " in message, message
    assert "deepspeed/module_inject/auto_ep_presets/base.py" in message
    assert "transformers/utils/output_capturing.py" in message
    assert "engine=fsdp2" in message and "parallel.expert_size=1" in message


def test_without_expert_parallel_nothing_is_refused():
    spec = load_config({"engine": "deepspeed"})
    check_environment(spec, to_deepspeed(spec))
