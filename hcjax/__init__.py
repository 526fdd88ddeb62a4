"""hcjax: an asynchronous RL post-training system for MoE models in JAX."""

from hcjax.host_memory import keep_freed_memory as _keep_freed_memory

# Before JAX starts its threads: XLA:CPU's per-call temporaries reuse freed pages instead of
# page-faulting fresh ones in (hcjax/host_memory.py; HCJAX_HOST_MALLOC=system opts out).
_keep_freed_memory()
