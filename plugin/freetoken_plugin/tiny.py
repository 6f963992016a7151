"""Tiny random configurations of real transformers MoE architectures, for the demo and the tests."""
import torch

# No end-of-sequence token: generation always runs its full length, so token lists compare 1:1.
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=None,
            pad_token_id=0)


def tiny_config(arch: str, experts: int = 8, top_k: int = 2):
    import transformers as tf

    if arch == "mixtral":
        return tf.MixtralConfig(**TINY, intermediate_size=96, num_local_experts=experts, num_experts_per_tok=top_k)
    if arch == "qwen2_moe":  # with a shared expert
        return tf.Qwen2MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=experts,
                                 num_experts_per_tok=top_k, shared_expert_intermediate_size=48,
                                 decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=experts,
                                 num_experts_per_tok=top_k, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "olmoe":
        return tf.OlmoeConfig(**TINY, intermediate_size=32, num_experts=experts, num_experts_per_tok=top_k)
    if arch == "deepseek_v3":  # sigmoid routing, a shared expert, the first layer dense
        # MLA's attention takes as many key/value heads as query heads (with fewer, a mask or a
        # cache of a second turn fails to broadcast in transformers' own code).
        mla = {**TINY, "num_hidden_layers": 4, "num_key_value_heads": TINY["num_attention_heads"]}
        return tf.DeepseekV3Config(**mla, intermediate_size=96,
                                   moe_intermediate_size=32, n_routed_experts=experts, num_experts_per_tok=top_k,
                                   n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                   v_head_dim=16)
    if arch == "gpt_oss":  # biases, interleaved and transposed gate/up, swigluoai
        # GPT-OSS's context length: its YaRN RoPE (factor 32 over 4,096 positions) expects it, and
        # transformers warns about a RoPE factor that does not match it.
        gpt_oss = {**TINY, "max_position_embeddings": 32 * 4096}
        return tf.GptOssConfig(**gpt_oss, intermediate_size=32, num_local_experts=experts,
                               num_experts_per_tok=top_k, head_dim=16, sliding_window=64,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHES}")


ARCHES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def tiny_model(arch: str, seed: int = 0, dtype=torch.float32, **kw):
    """A tiny model of `arch` with random weights (biases and router too, so nothing is zero)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(arch, **kw)
    return random_weights(tf.AutoModelForCausalLM.from_config(config, dtype=dtype))


def random_weights(model):
    """`model` in eval mode with every weight but the norms' drawn from N(0, 0.2) (vectors: 0.05),
    from torch's current seed: large enough that its routing and greedy tokens depend on them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                continue
            p.normal_(0, 0.2 if p.dim() > 1 else 0.05)
    return model.eval()
