"""The "freetoken" experts implementation for transformers' ExpertsInterface: every experts class
decorated with use_experts_implementation dispatches here once the model is offloaded."""
import torch

BACKEND_NAME = "freetoken"
_registered = False


def freetoken_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    offloaded = getattr(self, "_freetoken_experts", None)
    if offloaded is None:
        raise RuntimeError(
            f"{type(self).__name__} is set to the 'freetoken' experts implementation but was not offloaded; "
            "convert the model with freetoken_plugin.offload_experts(model) or load it with freetoken_plugin.load_model")
    if getattr(self, "has_post_expert_norm", False):
        return per_route_with_post_norm(self, offloaded, hidden_states, top_k_index, top_k_weights)
    return offloaded(hidden_states, top_k_index, top_k_weights)


def per_route_with_post_norm(module, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """What transformers' implementations compute for has_post_expert_norm (MuseSpark): the
    module's post_expert_norm on each route's output, then the routing weight and the sum over a
    token's routes. `experts` computes one row per route (routing weight 1), so the norm sees each
    route's output alone, as expert_gemm's sum over routes would not let it."""
    tokens, top_k = top_k_index.shape[0], top_k_index.shape[-1]
    rows = hidden_states.repeat_interleave(top_k, dim=0) if top_k > 1 else hidden_states
    ones = torch.ones(tokens * top_k, 1, dtype=hidden_states.dtype, device=hidden_states.device)
    per_route = module.post_expert_norm(experts(rows, top_k_index.reshape(-1, 1), ones))
    weighted = per_route * top_k_weights.reshape(-1, 1)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def register() -> None:
    """Registers the backend with transformers (idempotent; the vLLM general-plugin entry point)."""
    global _registered
    if _registered:
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(BACKEND_NAME, freetoken_experts_forward)
    # transformers' FP8 experts (FP8Experts, from its block-FP8 quantizer) dispatch through an
    # interface of their own.
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        FP8ExpertsInterface = None
    if FP8ExpertsInterface is not None and FP8ExpertsInterface._global_mapping is not ExpertsInterface._global_mapping:
        FP8ExpertsInterface.register(BACKEND_NAME, freetoken_experts_forward)
    _registered = True
