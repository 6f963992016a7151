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
    return offloaded(hidden_states, top_k_index, top_k_weights)


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
