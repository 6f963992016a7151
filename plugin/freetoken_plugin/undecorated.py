"""MoE blocks whose experts class transformers does not decorate with use_experts_implementation:
its experts interface cannot dispatch them, so freetoken serves the ones listed here by replacing
the forward of the block that owns the experts (on the instance, which takes a subclass of its
class; the class is untouched). Every
other undecorated family stays refused (offload.no_experts_error).

Llama 4 (Llama4TextMoe owning Llama4TextExperts): the router's scores, sigmoid of the top-k logits,
scale each routed copy of the block's input, not the experts' outputs, and transformers runs every
expert on every token (the unrouted ones on zeros). Offloaded, the block routes as transformers
does and runs the routed pairs only: expert e on x * score with routing weight 1. That is the same
function, since an unrouted expert's input is zero and silu(0) * 0 = 0 adds exactly nothing; then
the shared expert, as transformers adds it.

DBRX (DbrxFFN owning DbrxExperts, whose `mlp`, a DbrxExpertGLU, holds the weights): the block
routes with its own router and its own route_tokens_to_experts (softmax of the logits, top-k,
the top-k weights divided by their p-norm, p = moe_normalize_expert_weights, where set) and calls
its experts in the decorated form, (hidden, top_k_index, top_k_weights); the experts compute
activation_fn(x w1_e^T) * (x v1_e^T) @ w2_e, each expert's [I, H] block of the three [E * I, H]
tensors w1, v1, w2 (layouts.py: the split layout; down's block is the transpose of an [out, in]
weight). Offloaded, the block routes the same way, by the same calls, and the offloaded experts
take the routed pairs.

JetMoE (JetMoeMoE, whose experts are two JetMoeParallelExperts of its own, input_linear [E, 2I, H]
with the gate's rows first and output_linear [E, H, I]): the block is its own experts module, the
weights a decorated class's fused layout under other names (FusedWeights); its router, a top-k of
the logits then a softmax of those k, and its output bias stay the block's. Offloaded, the block
calls its own router (whose logits transformers records), routes by the same top-k and softmax of
those logits, and adds its bias to the offloaded experts' sum.

Verify, do not guess: verify.check_block_forward runs the block's own forward and the replacement on a
probe, on a float32 copy of the block whose experts are one stand-in function for both (so it
needs no expert weights, and runs in load_model before any expert is read), and verify.py checks
the experts' function through `experts_function`, the class's own forward called in the
decorated form.
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .served_class import served_subclass

ExpertsCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SplitWeights:
    """Experts held as three tensors, gate, up and down, each the experts' [I, H] blocks stacked
    ([E * I, H]; down's block is the transpose of an [out, in] weight): where the experts class
    keeps them and what its forward reads them by (layouts.py reads the split layout from these)."""
    names: Tuple[str, str, str]  # gate, up, down: parameter paths under the experts module
    sizes: Tuple[str, str, str]  # the experts module's attributes its forward splits them by: E, I, H
    act_fn: str                  # the path of the gate's activation object under the experts module


@dataclass(frozen=True)
class FusedWeights:
    """Experts held in a decorated class's fused layout ([E, 2I, H] gate rows then up rows, [E, H, I])
    under other names, by a block that is its own experts module (JetMoE's)."""
    names: Tuple[str, str, str, str]  # w13, w2, b13, b2: parameter paths under the block (absent biases: none)
    act_fn: str                       # the path of the gate's activation object under the block
    block_tensors: Tuple[str, ...]    # the block's own tensors besides the experts' (router, output bias)


@dataclass(frozen=True)
class UndecoratedFamily:
    block_class: str
    experts_class: str
    # What a decorated class keeps as attributes (is_transposed, is_concatenated, has_bias), hard-coded
    # in this class's forward.
    flags: Dict[str, bool]
    # (block, experts(hidden, top_k_index, top_k_weights), hidden_states) -> what the block returns.
    routed_forward: Callable
    # (experts module, hidden, top_k_index, top_k_weights) -> the class's own forward, in the decorated
    # form (each token's expert outputs weighted and summed).
    experts_function: Callable
    # (block, what block.router returned) -> top_k_index [T, K] (for recording traces).
    routed_ids: Callable
    # (block, a function f(rows, expert_ids)) -> {id(module): its stand-in}: the modules that compute
    # the block's experts, each replaced by one that computes f as the block calls it (a deep copy's
    # memo; verify.py's block check).
    stand_ins: Callable
    # Experts held as three tensors (DBRX); None: fused gate_up_proj / down_proj, read as a decorated
    # class's (with `flags`).
    split: Optional[SplitWeights] = None
    # Fused experts under other names, the block being its own experts module (JetMoE).
    fused: Optional[FusedWeights] = None
    # The block's attribute that holds its experts module; None: the block itself (`fused`).
    experts_attr: Optional[str] = "experts"


def _llama4_top_k(block, router_logits: torch.Tensor) -> torch.Tensor:
    """The experts Llama4Router routes to: its own top-k of its logits (the same op on the same
    values gives the same experts)."""
    return torch.topk(router_logits, block.router.top_k, dim=1).indices


def _llama4_routed_forward(block, experts: ExpertsCall, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward with the routed pairs only (see the module's docstring)."""
    hidden_states = hidden_states.reshape(-1, block.hidden_dim)
    router_scores, router_logits = block.router(hidden_states)  # scores: [T, E], zero where not routed
    top_k_index = _llama4_top_k(block, router_logits)
    scores = router_scores.gather(1, top_k_index)
    tokens, k = top_k_index.shape
    routed_in = (hidden_states.unsqueeze(1) * scores.unsqueeze(2)).reshape(tokens * k, block.hidden_dim)
    ones = torch.ones(tokens * k, 1, dtype=hidden_states.dtype, device=hidden_states.device)
    routed_out = experts(routed_in, top_k_index.reshape(tokens * k, 1), ones)
    out = block.shared_expert(hidden_states)
    out.add_(routed_out.view(tokens, k, block.hidden_dim).sum(dim=1))
    return out, router_logits


def _llama4_experts_function(experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """Llama4TextExperts.forward (a bmm over every expert of its parameters, one row block per
    expert) on the routed experts only: their weights set as the module's for the call, each
    routed token's row in its expert's block, zeros elsewhere."""
    ids, where = torch.unique(top_k_index, return_inverse=True)
    tokens, hidden_size = hidden.shape
    rows = torch.arange(tokens, device=hidden.device)
    saved = {n: experts._parameters[n] for n in ("gate_up_proj", "down_proj")}
    try:
        for n, p in saved.items():
            experts._parameters[n] = torch.nn.Parameter(p.detach()[ids], requires_grad=False)
        out = torch.zeros_like(hidden)
        for k in range(top_k_index.shape[1]):  # one call per routing rank: a token reaches an expert once per call
            dense = hidden.new_zeros(len(ids), tokens, hidden_size)
            dense[where[:, k], rows] = hidden
            per_expert = experts(dense.reshape(-1, hidden_size)).view(len(ids), tokens, hidden_size)
            out += per_expert[where[:, k], rows] * top_k_weights[:, k, None]
        return out
    finally:
        for n, p in saved.items():
            experts._parameters[n] = p


class _Llama4DenseStandIn(torch.nn.Module):
    """Called as Llama4TextMoe calls its experts: one block of rows per expert, in expert order."""

    def __init__(self, stand_in):
        super().__init__()
        self.stand_in = stand_in

    def forward(self, routed_in: torch.Tensor) -> torch.Tensor:
        experts = self.stand_in.coefficients.shape[0]
        per_expert = routed_in.view(experts, -1, routed_in.shape[-1])
        ids = torch.arange(experts, device=routed_in.device)[:, None]
        return self.stand_in(per_expert, ids).reshape(routed_in.shape)


def _dbrx_routing(block, router_logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(top_k_weights, top_k_index) of DbrxFFN: its own route_tokens_to_experts on its router's
    logits (softmax, top-k, the p-norm of moe_normalize_expert_weights), as its forward calls it."""
    return block.route_tokens_to_experts(router_logits)


def _dbrx_routed_forward(block, experts: ExpertsCall, hidden_states: torch.Tensor):
    """DbrxFFN.forward with the offloaded experts: the block's router and routing, the experts
    called with one row per token; returned as DbrxExperts returns it, [batch, -1, H] of the
    block's input's leading dimension."""
    top_k_weights, top_k_index = _dbrx_routing(block, block.router(hidden_states))
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    out = experts(hidden, top_k_index, top_k_weights)
    return out.reshape(hidden_states.shape[0], -1, hidden_states.shape[-1])


def _dbrx_experts_function(experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """DbrxExperts.forward, already the decorated form; its [T, 1, H] for T rows as [T, H]."""
    return experts(hidden, top_k_index, top_k_weights).reshape(hidden.shape)


class _DbrxStandIn(torch.nn.Module):
    """Called as DbrxFFN calls its experts, (hidden_states, top_k_index, top_k_weights), and
    returning as DbrxExperts does ([batch, -1, H] of the input's leading dimension)."""

    def __init__(self, stand_in):
        super().__init__()
        self.stand_in = stand_in

    def forward(self, hidden_states, top_k_index, top_k_weights):
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = self.stand_in.routed(hidden, top_k_index, top_k_weights)
        return out.reshape(hidden_states.shape[0], -1, hidden_states.shape[-1])


def _jetmoe_routing(block, router_logits: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """(top_k_weights, top_k_index) of JetMoeTopKGating from its logits: the top k, then a softmax of
    those k, in the hidden states' dtype (its own ops on the same values)."""
    top_k_logits, top_k_index = router_logits.topk(block.router.top_k, dim=1)
    return torch.softmax(top_k_logits, dim=1).to(dtype), top_k_index


def _jetmoe_routed_forward(block, experts: ExpertsCall, layer_input: torch.Tensor):
    """JetMoeMoE.forward with the offloaded experts: the block's own router (its logits are what
    transformers records), its top-k and softmax, then the block's bias on the experts' sum."""
    bsz, length, hidden_size = layer_input.size()
    hidden = layer_input.reshape(-1, hidden_size)
    router_logits = block.router(hidden)[4]
    top_k_weights, top_k_index = _jetmoe_routing(block, router_logits, hidden.dtype)
    out = experts(hidden, top_k_index, top_k_weights)
    return out.view(bsz, length, hidden_size) + block.bias


class _JetMoeFixedRouting(torch.nn.Module):
    """Returns what JetMoeTopKGating returns for a given routing (top_k_index, top_k_weights): the
    block's own code then computes those routes (experts_function)."""

    def __init__(self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int):
        super().__init__()
        self.top_k_index, self.top_k_weights, self.experts = top_k_index, top_k_weights, experts

    def forward(self, hidden):
        index, k = self.top_k_index, self.top_k_index.shape[1]
        expert_size = torch.bincount(index.flatten(), minlength=self.experts).tolist()
        _, index_sorted = index.flatten().sort(0)
        batch_index = index_sorted.div(k, rounding_mode="trunc")
        batch_gates = self.top_k_weights.to(hidden.dtype).flatten()[index_sorted]
        return index_sorted, batch_index, batch_gates, expert_size, None


def _jetmoe_experts_function(block: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """JetMoeMoE.forward itself on the given routing (its router set aside for one returning it) and
    a zero bias: each token's expert outputs weighted and summed, as the block computes them."""
    saved_router, saved_bias = block._modules["router"], block._parameters["bias"]
    try:
        block._modules["router"] = _JetMoeFixedRouting(top_k_index, top_k_weights, block.input_linear.num_experts)
        block._parameters["bias"] = torch.nn.Parameter(torch.zeros_like(saved_bias), requires_grad=False)
        return type(block).forward(block, hidden[None])[0]
    finally:
        block._modules["router"], block._parameters["bias"] = saved_router, saved_bias


# The gate's value in the JetMoE stand-in: large enough that the usual activations return it
# unchanged (silu, gelu, relu at 32 in float32), a power of two so that scaling by it is exact.
_JETMOE_STAND_IN_GATE = 32.0


class _JetMoeInputStandIn(torch.nn.Module):
    """In place of input_linear, called as the block calls it (rows grouped by expert, the group
    sizes): [gate; up] rows whose gate is a constant and whose up is the stand-in's f(rows)."""

    def __init__(self, stand_in):
        super().__init__()
        self.stand_in = stand_in

    def forward(self, inputs, expert_size):
        experts = torch.arange(len(expert_size), device=inputs.device)
        ids = experts.repeat_interleave(torch.as_tensor(expert_size, device=inputs.device))
        up = self.stand_in(inputs, ids)
        return torch.cat([torch.full_like(up, _JETMOE_STAND_IN_GATE), up], dim=-1)


class _JetMoeOutputStandIn(torch.nn.Module):
    """In place of output_linear: divides the block's activation(gate) * up by activation(gate),
    the block's own activation of the constant gate (exactly the gate for the usual ones)."""

    def __init__(self, activation):
        super().__init__()
        self.activation = activation

    def forward(self, inputs, expert_size):
        gate = self.activation(torch.full((1,), _JETMOE_STAND_IN_GATE, dtype=inputs.dtype, device=inputs.device))
        return inputs / gate


FAMILIES = (
    UndecoratedFamily("Llama4TextMoe", "Llama4TextExperts",
                      dict(is_transposed=True, is_concatenated=True, has_bias=False),
                      _llama4_routed_forward, _llama4_experts_function,
                      lambda block, router_output: _llama4_top_k(block, router_output[1]),
                      lambda block, stand_in: {id(block.experts): _Llama4DenseStandIn(stand_in)}),
    UndecoratedFamily("DbrxFFN", "DbrxExperts",
                      dict(is_transposed=False, is_concatenated=True, has_bias=False),
                      _dbrx_routed_forward, _dbrx_experts_function,
                      lambda block, router_logits: _dbrx_routing(block, router_logits)[1],
                      lambda block, stand_in: {id(block.experts): _DbrxStandIn(stand_in)},
                      split=SplitWeights(("mlp.w1", "mlp.v1", "mlp.w2"),
                                         ("num_experts", "ffn_hidden_size", "hidden_size"), "mlp.activation_fn")),
    UndecoratedFamily("JetMoeMoE", "JetMoeMoE",
                      dict(is_transposed=False, is_concatenated=True, has_bias=False),
                      _jetmoe_routed_forward, _jetmoe_experts_function,
                      lambda block, router_output: _jetmoe_routing(block, router_output[4], torch.float32)[1],
                      lambda block, stand_in: {id(block.input_linear): _JetMoeInputStandIn(stand_in),
                                               id(block.output_linear): _JetMoeOutputStandIn(block.activation)},
                      fused=FusedWeights(("input_linear.weight", "output_linear.weight", "input_linear.bias",
                                          "output_linear.bias"), "activation", ("bias", "router.layer.weight")),
                      experts_attr=None),
)
_BY_EXPERTS = {f.experts_class: f for f in FAMILIES}
_BY_BLOCK = {f.block_class: f for f in FAMILIES}


def family_of(experts: torch.nn.Module) -> Optional[UndecoratedFamily]:
    """The family an experts module belongs to, by its exact class (a subclass may compute otherwise)."""
    return _BY_EXPERTS.get(type(experts).__name__)


def experts_of(block: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The experts module of a block of a family listed here (the block itself for JetMoE's); None
    for any other module, or a block that holds no experts of its family."""
    family = _BY_BLOCK.get(type(block).__name__)
    if family is None:
        return None
    experts = block if family.experts_attr is None else block._modules.get(family.experts_attr)
    return experts if experts is not None and type(experts).__name__ == family.experts_class else None


def served_blocks(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, block) of every block in `model` that owns experts of a family listed here."""
    return [(name, module) for name, module in model.named_modules() if experts_of(module) is not None]


def owner_block(model: torch.nn.Module, experts_name: str) -> torch.nn.Module:
    """The block that owns the experts module named `experts_name` (the module itself where the
    block is its own experts module)."""
    module = model.get_submodule(experts_name)
    if experts_of(module) is module:
        return module
    return model.get_submodule(experts_name.rpartition(".")[0])


def _routed_forward_methods(cls: type) -> dict:
    """The served block's forward (served_class.py): its family's routed forward through the
    offloaded experts, read at each call (so a copy of the model runs its own)."""
    family = _BY_BLOCK[cls.__name__]

    def forward(self, hidden_states):
        return family.routed_forward(self, experts_of(self)._freetoken_experts, hidden_states)
    return {"forward": forward}


def _is_served(block) -> bool:
    experts = experts_of(block)
    return experts is not None and "_freetoken_experts" in experts.__dict__


def switch_block(block: torch.nn.Module) -> Callable[[], None]:
    """Makes `block` run its family's routed forward through the offloaded experts (the instance
    takes a subclass of its class, served_class.py; the class is untouched; a forward set on the
    instance, such as an accelerate hook's, is set aside while the block is served); returns what
    puts the block back as it was."""
    original = type(block)
    instance_forward = block.__dict__.pop("forward", None)
    block.__class__ = served_subclass(original, "served block", _routed_forward_methods, _is_served)

    def restore():
        block.__class__ = original
        if instance_forward is not None:
            block.__dict__["forward"] = instance_forward
    return restore
