"""Entry point `python -m hcjax.sft`: SFT / pre-training / self-distillation (hcjax.distill.sft)."""

from hcjax.config import run_main
from hcjax.distill.sft import main
from hcjax.host_memory import keep_freed_memory

if __name__ == "__main__":
    keep_freed_memory()  # a training-only process (hcjax/host_memory.py), before JAX's threads
    run_main(main)
