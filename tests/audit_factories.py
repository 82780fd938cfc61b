"""MODEL factories for the audit tests (`tests.audit_factories:NAME`)."""
import torch
import torch.nn.functional as F

from fp8dist.runtime.models import causal_lm_batch, load_model


class LinearRouterBlock(torch.nn.Module):
    """An MoE block whose router is an nn.Linear `gate` beside its `experts` (as transformers 5 afmoe's)."""

    def __init__(self, hidden=64, experts=8):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden)])
        self.up = torch.nn.Linear(hidden, hidden)


class SecretlyFP32(torch.nn.Module):
    """Looks like a normal LM, but every matmul upcasts to fp32 whatever the config says."""

    def __init__(self, vocab=256, hidden=64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        x = F.linear(x.float(), self.proj.weight.float(), self.proj.bias.float()).relu()
        logits = F.linear(x.float(), self.head.weight.float(), self.head.bias.float())
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def secretly_fp32():
    return {"model": SecretlyFP32(), "make_batch": causal_lm_batch(256)}


class AdamWithBf16States(torch.optim.Optimizer):
    """A user optimizer that keeps its moments in bf16 (whatever the parameters are)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
                grad = p.grad.to(torch.bfloat16)
                state["exp_avg"].mul_(b1).add_(grad, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])


def tiny_llama_bf16_states():
    loaded = load_model("tiny-llama", "fp32")
    return {"model": loaded.model, "make_batch": loaded.make_batch, "make_optimizer": AdamWithBf16States}


class TokenMLP(torch.nn.Module):
    """A bare module (no config, no make_batch) whose first module is an nn.Embedding: token-id input."""

    def __init__(self, vocab=128, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.up = torch.nn.Linear(hidden, 64)
        self.down = torch.nn.Linear(64, vocab)

    def forward(self, tokens):
        return self.down(self.up(self.embed(tokens)).relu())


class FeatureMLP(torch.nn.Module):
    """A bare module whose first module is an nn.Linear: a float input of its in_features."""

    def __init__(self, features=48):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))

    def forward(self, x):
        return self.net(x)


class ConvFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3)

    def forward(self, x):
        return self.conv(x)


def token_mlp():
    return TokenMLP()


def feature_mlp():
    return FeatureMLP()


def conv_first():
    return ConvFirst()


def raises():
    raise RuntimeError("weights file /data/ckpt.pt is missing")


def _tiny_moe(arch):
    import transformers

    from fp8dist.config.models import tiny_moe_config

    torch.manual_seed(0)
    config = tiny_moe_config(arch)
    return {"model": transformers.AutoModelForCausalLM.from_config(config), "make_batch": causal_lm_batch(256)}


def tiny_qwen3_moe():
    return _tiny_moe("qwen3_moe")


def tiny_olmoe():
    return _tiny_moe("olmoe")
