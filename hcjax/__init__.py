"""hcjax: an asynchronous RL post-training system for MoE models in JAX."""

from hcjax.host_memory import apply_from_environment as _apply_host_malloc

# HCJAX_HOST_MALLOC=keep: freed heap pages stay with the process (hcjax/host_memory.py), set
# before JAX starts its threads.
_apply_host_malloc()
