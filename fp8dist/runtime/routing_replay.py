"""`fp8dist compare --fixed-routing`: the baseline's expert choices replayed in the config's run, so that the two
runs of a Mixture-of-Experts model send every token to the same experts and their gap is the experts' (and the
rest of the model's) numerics, not routing flips.

A top-k router picks each token's experts by `torch.topk` over its scores (transformers 5.x: MixtralTopKRouter,
Qwen3MoeTopKRouter, GptOssTopKRouter in models/*/modeling_*.py, each the `gate` or `router` beside an `experts`
module). While a router runs, a TorchFunctionMode answers its `torch.topk`:
- recording (the baseline): the real top-k, its indices kept in call order per router;
- replaying (the config): the recorded indices, and this run's own scores at them (`gather`), so that what the
  router does with its top values next (renormalise, softmax) and its gradient stay this run's.
Calls during backward (an activation-checkpoint recompute) are not new choices: the recording leaves them out,
the replay repeats, call by call, the choices of the forward it recomputes (a router may call top-k more than once
per forward: DeepSeek-V3's group-limited routing does). Both runs make the same calls in the same order (same
steps, micro-batches and layer probes), which `check_consumed` confirms at the end. Routers are keyed by their
module names without the wrappers' parts (PEFT's prefix, checkpoint_wrapper's), so the two configs may differ in
adapters or activation checkpointing. Memory: every choice of the baseline's run, kept on the CPU as int32 until
the config's run replays it (steps x micro-batches x MoE layers x tokens x top-k x 4 bytes).
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fp8dist.backends.experts import experts_modules
from fp8dist.engines.activation_checkpointing import in_backward
from fp8dist.errors import Fp8distError
from fp8dist.runtime.layer_probes import layer_name

ROUTER_NAMES = ("gate", "router")  # the router's attribute beside `experts` in transformers' MoE blocks


def routers(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the router beside each experts module; refuses a model without one."""
    found = []
    for name, _experts in experts_modules(model):
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        router = next(((child_name, child) for child_name, child in parent.named_children()
                       if child_name in ROUTER_NAMES), None)
        if router is None:
            raise Fp8distError(f"--fixed-routing: the MoE block {parent_name} ({type(parent).__name__}) has no "
                               f"`{'` or `'.join(ROUTER_NAMES)}` router beside its experts"
                               "\n  fix: drop --fixed-routing")
        found.append((f"{parent_name}.{router[0]}", router[1]))
    if not found:
        raise Fp8distError("--fixed-routing replays a Mixture-of-Experts model's expert choices, and this model has "
                           "no experts module\n  fix: drop --fixed-routing, or compare an MoE model")
    return found


class _TopK(TorchFunctionMode):
    def __init__(self, log: "RoutingLog", key: str):
        super().__init__()
        self.log, self.key = log, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk):
            return func(*args, **kwargs)
        return self.log.top_k(self.key, func, args, kwargs)


class RoutingLog:
    """The top-k choices of every router, in call order: recorded by one run, replayed in another."""

    def __init__(self):
        self.calls: dict[str, deque[torch.Tensor]] = defaultdict(deque)
        self.replaying = False
        self._forward: dict[str, list[torch.Tensor]] = defaultdict(list)  # the last forward's choices, in order
        self._recomputed: dict[str, int] = defaultdict(int)  # how many of them a recompute has repeated
        self._hooks: list[Any] = []
        self._modes: dict[str, _TopK] = {}

    def install(self, model, *, replay: bool) -> None:
        self.replaying = replay
        for name, router in routers(model):
            key = layer_name(name)
            self._hooks.append(router.register_forward_pre_hook(lambda module, args, key=key: self._enter(key)))
            self._hooks.append(router.register_forward_hook(lambda module, args, out, key=key: self._exit(key),
                                                            always_call=True))

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def check_consumed(self) -> None:
        left = {key: len(queue) for key, queue in self.calls.items() if queue}
        if self.replaying and left:
            raise Fp8distError(f"--fixed-routing: the config's run made fewer router calls than the baseline's "
                               f"({left} left over): the two runs do not step alike")

    def _enter(self, key: str) -> None:
        if in_backward():
            self._recomputed[key] = 0
        else:
            self._forward[key] = []
        self._modes[key] = _TopK(self, key)
        self._modes[key].__enter__()

    def _exit(self, key: str) -> None:
        self._modes.pop(key).__exit__(None, None, None)

    def top_k(self, key: str, func, args, kwargs):
        if not self.replaying:
            values, indices = func(*args, **kwargs)
            if not in_backward():
                self.calls[key].append(indices.detach().to("cpu", torch.int32))
            return values, indices
        if in_backward():
            indices = self._forward[key][self._recomputed[key]]
            self._recomputed[key] += 1
        elif self.calls[key]:
            indices = self.calls[key].popleft()
            self._forward[key].append(indices)
        else:
            raise Fp8distError(f"--fixed-routing: {key} was called more often in the config's run than in the "
                               "baseline's: the two runs do not step alike")
        scores = args[0]
        if indices.shape[:-1] != scores.shape[:-1]:
            raise Fp8distError(f"--fixed-routing: {key} routes {tuple(scores.shape[:-1])} tokens here and routed "
                               f"{tuple(indices.shape[:-1])} in the baseline: the runs must see the same batches "
                               "on the same ranks")
        indices = indices.to(scores.device, torch.int64)
        return torch.return_types.topk((scores.gather(-1, indices), indices))
