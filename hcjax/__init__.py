"""hcjax: an asynchronous RL post-training system for MoE models in JAX.

Importing it sets nothing process-wide: entry points make their settings (JAX's platforms, host
malloc, CPU device count) in `hcjax.config.run_main`, scripts by `hcjax.config.setup_process()`.
"""
