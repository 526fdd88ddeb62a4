"""hcjax: an asynchronous RL post-training system for MoE models in JAX."""
