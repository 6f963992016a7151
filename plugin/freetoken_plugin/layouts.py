"""Reading a transformers experts module: its shape, activation and weight layout, and the
conversion of its weights into the canonical host layout (w13 [E, 2I, H] gate rows then up rows,
w2 [E, H, I], b13 [E, 2I], b2 [E, H])."""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from ft_ops.activations import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

# config.hidden_act -> expert_gemm activation
ACTIVATION_OF = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                 "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


class UnsupportedExperts(ValueError):
    """The experts module cannot be served by the freetoken backend (with the reason)."""


@dataclass(frozen=True)
class ExpertsLayout:
    experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    activation: str
    transposed: bool    # gate_up_proj stored [E, H, 2I] and down_proj [E, I, H]
    concatenated: bool  # gate/up as [gate; up] (True) or interleaved gate0, up0, gate1, ... (False)
    bias: bool


def is_experts_module(module: torch.nn.Module) -> bool:
    """A module whose class transformers decorated with use_experts_implementation."""
    return hasattr(module, "is_concatenated") and hasattr(module, "down_proj") and hasattr(module, "config")


def read_layout(module: torch.nn.Module) -> ExpertsLayout:
    name = type(module).__name__
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        raise UnsupportedExperts(f"{name} has no fused gate_up_proj (experts without a gate are not supported)")
    if getattr(module, "has_post_expert_norm", False):
        raise UnsupportedExperts(f"{name} applies a norm after each expert, which expert_gemm does not")
    gate_up, down = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    if gate_up.dim() != 3 or down.dim() != 3:
        raise UnsupportedExperts(f"{name}: expected 3-D gate_up_proj and down_proj, got {tuple(gate_up.shape)} and {tuple(down.shape)}")
    experts = gate_up.shape[0]
    hidden, two_i = (gate_up.shape[1], gate_up.shape[2]) if transposed else (gate_up.shape[2], gate_up.shape[1])
    if two_i % 2:
        raise UnsupportedExperts(f"{name}: gate_up_proj has an odd width {two_i}")
    inter = two_i // 2
    want_down = (experts, inter, hidden) if transposed else (experts, hidden, inter)
    if tuple(down.shape) != want_down:
        raise UnsupportedExperts(f"{name}: down_proj is {tuple(down.shape)}, expected {want_down}")
    bias = bool(getattr(module, "has_bias", False))
    activation = _activation(module, name)
    return ExpertsLayout(experts, hidden, inter, gate_up.dtype, activation, transposed,
                         bool(getattr(module, "is_concatenated", True)), bias)


def _activation(module, name: str) -> str:
    if hasattr(module, "alpha") and hasattr(module, "limit"):  # gpt-oss's clamped SwiGLU
        if abs(float(module.alpha) - SWIGLUOAI_ALPHA) > 1e-6 or abs(float(module.limit) - SWIGLUOAI_LIMIT) > 1e-6:
            raise UnsupportedExperts(f"{name}: swiglu alpha={module.alpha}, limit={module.limit}; the kernels implement "
                                     f"alpha={SWIGLUOAI_ALPHA}, limit={SWIGLUOAI_LIMIT}")
        return "swigluoai"
    act = getattr(module.config, "hidden_act", None)
    if act not in ACTIVATION_OF:
        raise UnsupportedExperts(f"{name}: activation {act!r} is not supported; expected one of {sorted(ACTIVATION_OF)}")
    return ACTIVATION_OF[act]


def canonical_weights(module: torch.nn.Module, layout: ExpertsLayout
                      ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The module's weights as (w13 [E, 2I, H], w2 [E, H, I], b13, b2), views or copies on the
    module's device; the caller copies them into the host pool."""
    b13 = module.gate_up_proj_bias.detach() if layout.bias else None
    b2 = module.down_proj_bias.detach() if layout.bias else None
    return to_canonical(module.gate_up_proj.detach(), module.down_proj.detach(), b13, b2, layout)


def to_canonical(gate_up: torch.Tensor, down: torch.Tensor, b13: Optional[torch.Tensor],
                 b2: Optional[torch.Tensor], layout: ExpertsLayout):
    """Fused weights in the module's layout -> (w13 [E, 2I, H], w2 [E, H, I], b13 [E, 2I], b2)."""
    if layout.transposed:
        gate_up = gate_up.transpose(1, 2)  # [E, 2I, H]
        down = down.transpose(1, 2)        # [E, H, I]
    if not layout.concatenated:  # rows alternate gate, up, gate, up, ...
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
        if b13 is not None:
            b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    return gate_up, down, b13, b2
