"""Recording the routing of a transformers MoE model (ft_ops/traces.py's Trace) during a greedy
generation: a forward pre-hook on every experts block (the classes decorated with
use_experts_implementation) records the top_k_index it receives, prompt first, then one row per
fed-back token; for the undecorated blocks freetoken serves (undecorated.py), a forward hook on the
block's router records the experts it routes to."""
from typing import List

import torch

from ft_ops.traces import Trace

from .layouts import UnsupportedExperts, read_layout
from .offload import find_experts
from .undecorated import FAMILIES, family_of, owner_block

SERVED_BLOCKS = [family.block_class for family in FAMILIES]


def _layout_experts(module: torch.nn.Module) -> int:
    """Experts per layer as the module's weights hold them (JetMoE's block names no num_experts); 0
    where its layout cannot be read."""
    try:
        return read_layout(module).experts
    except UnsupportedExperts:
        return 0


@torch.no_grad()
def record_trace(model: torch.nn.Module, prompts: List[torch.Tensor], new_tokens: int, source: str = "") -> Trace:
    """Greedy generation of `new_tokens` after each prompt (1-D token ids), recording the routed
    expert ids of every token the model processed."""
    experts = find_experts(model)
    blocks = [m for _, m in experts]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no experts block to trace (a class decorated with "
                         f"transformers' use_experts_implementation, or a {' or '.join(SERVED_BLOCKS)})")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
    calls: List[List[torch.Tensor]] = [[] for _ in blocks]

    def record(i, ids):
        calls[i].append(ids.detach().reshape(-1, ids.shape[-1]).to("cpu", torch.int16))

    def hook_for(i, name, module):
        family = family_of(module)
        if family is None:
            return module.register_forward_pre_hook(
                lambda _, args, kwargs: record(i, args[1] if len(args) > 1 else kwargs["top_k_index"]),
                with_kwargs=True)
        block = owner_block(model, name)
        return block.router.register_forward_hook(lambda _, args, output: record(i, family.routed_ids(block, output)))

    handles = [hook_for(i, name, m) for i, (name, m) in enumerate(experts)]
    sequences, prompt_lengths = [], []
    device = next(model.parameters()).device
    try:
        for prompt in prompts:
            if prompt.dim() != 1 or prompt.numel() == 0:
                raise ValueError("each prompt must be a non-empty 1-D tensor of token ids")
            for c in calls:
                c.clear()
            model.generate(prompt[None].to(device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
            per_layer = [torch.cat(c, dim=0) for c in calls]  # [tokens, top_k] each
            sequences.append(torch.stack(per_layer, dim=1))
            prompt_lengths.append(prompt.numel())
    finally:
        for h in handles:
            h.remove()
    cfg = model.config
    top = blocks[0]
    handle = model.__dict__.get("_freetoken_handle")
    if handle is not None:  # an offloaded model (load_model's): its experts' shape as the pool holds it
        experts = handle.runtime.shape.experts
        hidden, inter = handle.runtime.shape.hidden, handle.runtime.shape.intermediate
    else:
        experts = int(getattr(top, "num_experts", 0) or _layout_experts(top) or sequences[0].max() + 1)
        hidden = int(getattr(cfg, "hidden_size", 0))
        inter = int(getattr(cfg, "moe_intermediate_size", 0) or getattr(cfg, "intermediate_size", 0))
    return Trace(sequences, prompt_lengths, experts, hidden, inter, source)
