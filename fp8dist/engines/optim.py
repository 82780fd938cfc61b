"""The optimizer named by `optimizer` in the config (torch.optim, or torchao's low-bit AdamW on FSDP2)."""
from __future__ import annotations

from fp8dist.config.rules import effective_state_dtype
from fp8dist.config.spec import Spec


def build_optimizer(params, spec: Spec):
    import torch

    opt = spec.optimizer
    state = effective_state_dtype(spec.to_dict())
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, weight_decay=opt.weight_decay)
    kwargs = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    if state in ("fp8", "int8"):
        from torchao.optim import AdamW8bit, AdamWFp8

        return (AdamWFp8 if state == "fp8" else AdamW8bit)(params, **kwargs)
    return (torch.optim.Adam if opt.name == "adam" else torch.optim.AdamW)(params, **kwargs)
