"""The expert function of expert_gemm: act(gate, up) on the two halves of w13 @ x + b13.

An Activation is a kind plus parameters, not one name per model family, so every family in
transformers is a set of values the kernels already take (docs/families.md lists them). With g and u
the gate and up halves, in float32:

    limit > 0:       g = min(g, limit);  u = clamp(u, -limit, limit)
                     (limit_after_act: g unclamped, and lin(g) * phi(g) clamped at limit below)
    up_softcap > 0:  u = up_softcap * tanh(u / up_softcap)
                     u = u + up_offset
    act = lin(g) * phi(g) * u,   lin(g) = gate_softcap * tanh(g / gate_softcap) if gate_softcap else g
          (limit_after_act: act = min(lin(g) * phi(g), limit) * u, as Step3p7 computes it)
    phi(g) = sigmoid(alpha * g)                                     kind "silu"
             0.5 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3)))    kind "gelu_tanh"
             0.5 * (1 + erf(g / sqrt(2)))                           kind "gelu"
             1 if g > 0 else 0                                      kind "relu"

so phi sees the clamped gate and the gate's softcap bounds only its linear factor (Inkling2).
Ungated experts (gated=False: w13 holds the up projection alone, [I, H] an expert) take the up
values as the gate too, g = u: kind "relu" then computes max(u, 0) * u = relu(u)^2, Nemotron-H's
expert (RELU2).
"""
import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

# float32's normal range: the kernels keep the activation's parameters in float32.
FLOAT32_NORMAL_MIN = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e+38

KINDS = ("silu", "gelu_tanh", "gelu", "relu")


@dataclass(frozen=True)
class Activation:
    kind: str = "silu"
    alpha: float = 1.0         # slope of the sigmoid of kind "silu" (1.702: gpt-oss)
    limit: float = 0.0         # clamp: gate above, up on both sides; 0: off
    up_offset: float = 0.0     # added to up (gpt-oss: (up + 1))
    gate_softcap: float = 0.0  # cap of the gate's linear factor; 0: off
    up_softcap: float = 0.0    # cap of up; 0: off
    limit_after_act: bool = False  # the gate's clamp on lin(g) * phi(g) rather than on g
    gated: bool = True         # w13 holds gate and up rows; False: up rows alone, g = u

    def __post_init__(self):
        # The same rules as the kernels (src/common/checks.h), checked here so a bad value fails
        # where it is written rather than at the first forward.
        if self.kind not in KINDS:
            raise ValueError(f"unknown activation kind {self.kind!r}; expected one of {KINDS}")
        for name in ("alpha", "limit", "up_offset", "gate_softcap", "up_softcap"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"activation {name} must be a finite number, got {value!r}")
            # The kernels compute in float32: a magnitude outside its normal range would become 0
            # (a limit or cap turned off) or infinity.
            if value != 0 and not FLOAT32_NORMAL_MIN <= abs(value) <= FLOAT32_MAX:
                raise ValueError(f"activation {name}={value!r} does not fit float32 (0, or a magnitude in "
                                 f"[{FLOAT32_NORMAL_MIN:.2g}, {FLOAT32_MAX:.2g}])")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.limit_after_act, bool):
            raise ValueError(f"limit_after_act must be a bool, got {self.limit_after_act!r}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"gated must be a bool, got {self.gated!r}")
        if self.limit_after_act and self.limit == 0:
            raise ValueError("limit_after_act clamps the activated gate at limit, so it needs a limit > 0")
        if self.kind != "silu" and self.alpha != 1.0:
            raise ValueError(f"alpha scales the sigmoid of kind 'silu' only; kind {self.kind!r} needs alpha=1")
        if self.limit < 0 or self.gate_softcap < 0 or self.up_softcap < 0:
            raise ValueError(f"limit and softcaps must be >= 0 (0 turns them off), got limit={self.limit}, "
                             f"gate_softcap={self.gate_softcap}, up_softcap={self.up_softcap}")

    def op_args(self) -> Tuple[str, float, float, float, float, float]:
        """(activation, alpha, limit, up_offset, gate_softcap, up_softcap) as expert_gemm takes them
        (limit_after_act and gated are its last arguments: function_args)."""
        return self.kind, self.alpha, self.limit, self.up_offset, self.gate_softcap, self.up_softcap

    def function_args(self) -> Tuple[str, float, float, float, float, float, bool, bool]:
        """op_args() + (limit_after_act, gated): the whole expert function, as the CPU share takes it."""
        return self.op_args() + (self.limit_after_act, self.gated)

    def __str__(self) -> str:
        extras = [f"{n}={getattr(self, n):g}" for n, default in
                  (("alpha", 1.0), ("limit", 0.0), ("up_offset", 0.0), ("gate_softcap", 0.0), ("up_softcap", 0.0))
                  if getattr(self, n) != default]
        if self.limit_after_act:
            extras.append("limit_after_act")
        if not self.gated:
            extras.append("ungated")
        return self.kind + (f"({', '.join(extras)})" if extras else "")


SILU = Activation("silu")
GELU_TANH = Activation("gelu_tanh")
GELU = Activation("gelu")
# gpt-oss's clamped SwiGLU: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7).
SWIGLUOAI = Activation("silu", alpha=1.702, limit=7.0, up_offset=1.0)
# Ungated relu(up)^2 (Nemotron-H): w13 holds the up rows alone, and max(u, 0) * u is relu(u)^2.
RELU2 = Activation("relu", gated=False)

PRESETS = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU, "swigluoai": SWIGLUOAI, "relu2": RELU2}


def as_activation(activation: Union[Activation, str]) -> Activation:
    """An Activation, or the preset of that name ("silu", "gelu_tanh", "gelu", "swigluoai", "relu2")."""
    if isinstance(activation, Activation):
        return activation
    preset = PRESETS.get(activation) if isinstance(activation, str) else None
    if preset is None:
        raise ValueError(f"unknown activation {activation!r}; pass an ft_ops.activations.Activation or one of "
                         f"the presets {sorted(PRESETS)}")
    return preset


def per_layer(activation: Union[Activation, str, Sequence[Union[Activation, str]]], layers: int) -> List[Activation]:
    """One Activation per MoE layer: `activation` for every layer, or a sequence of one per layer
    (families such as Step3p7 clamp some layers only, or with limits of their own)."""
    if isinstance(activation, (Activation, str)):
        return [as_activation(activation)] * layers
    if not isinstance(activation, Sequence):
        raise TypeError(f"activation: an Activation, a preset name or one of them per MoE layer, got {activation!r}")
    activations = [as_activation(a) for a in activation]
    if len(activations) != layers:
        raise ValueError(f"one activation per MoE layer: {layers} layers, got {len(activations)} activations")
    return activations
