"""DeepSpeed runtime: `fp8dist.engines.deepspeed.initialize` mirrors `deepspeed.initialize`.

It checks the environment, applies the precision backend to the model (torchao float8 conversion,
Transformer Engine swap, MS-AMP's module marks), builds the optimizer the config names (or points the
caller's at the swapped parameters), and calls `deepspeed.initialize` with the translated config -- or,
for MS-AMP, `msamp.deepspeed.initialize` through the MS-AMP backend.
"""
from __future__ import annotations

from typing import Any

from fp8dist.backends.base import get_backend
from fp8dist.config.spec import Spec
from fp8dist.engines.optim import build_optimizer, rebind_optimizer, rebind_parameters
from fp8dist.environment import device_info
from fp8dist.errors import Fp8distError
from fp8dist.translate.deepspeed import to_deepspeed


def initialize(model, spec: Spec, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, **kwargs: Any):
    """Same return tuple as deepspeed.initialize: (engine, optimizer, training_dataloader, lr_scheduler).

    The backend used is available as `engine.fp8dist_backend`, the DeepSpeed config as
    `engine.fp8dist_config`.
    """
    if spec.engine != "deepspeed":
        raise Fp8distError(f"config engine is {spec.engine!r}; fp8dist.engines.deepspeed needs engine=deepspeed")
    if "config" in kwargs or "config_params" in kwargs:
        raise Fp8distError("fp8dist builds the DeepSpeed config from the fp8dist spec; put raw keys in "
                           "deepspeed.extra instead of passing config=")
    backend = get_backend(spec)
    backend.check_environment(device_info())  # a missing library is the first thing to say
    config = to_deepspeed(spec)
    before = dict(model.named_parameters())
    decisions = backend.convert_module(model)
    if optimizer is None:
        params = model.parameters() if model_parameters is None else rebind_parameters(model_parameters, before, model)
        optimizer = build_optimizer(params, spec)
    else:
        rebind_optimizer(optimizer, before, model)
    initialize_fn = backend.deepspeed_initialize if spec.fp8.backend == "msamp" else _deepspeed_initialize()
    engine, optimizer, dataloader, scheduler = initialize_fn(
        model=model, optimizer=optimizer, training_data=training_data, lr_scheduler=lr_scheduler,
        config=config, **kwargs)
    engine.fp8dist_backend = backend
    engine.fp8dist_config = config
    engine.fp8dist_decisions = decisions
    return engine, optimizer, dataloader, scheduler


def _deepspeed_initialize():
    import deepspeed

    return deepspeed.initialize


def train_step(engine, batches: list[dict]) -> float:
    """One optimizer step over `batches` (DeepSpeed counts the micro-steps); returns the mean loss."""
    from fp8dist.models import forward_loss

    total = 0.0
    for batch in batches:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        with engine.fp8dist_backend.forward_context():
            loss = forward_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float().item() / len(batches)
    return total
