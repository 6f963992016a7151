"""freetoken_plugin: runs Hugging Face transformers MoE models with their experts offloaded to a
pinned host pool and cached on the GPU by ft_ops."""
