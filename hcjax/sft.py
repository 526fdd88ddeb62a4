"""Entry point `python -m hcjax.sft`: SFT / pre-training / self-distillation (hcjax.distill.sft)."""

from hcjax.distill.sft import main

if __name__ == "__main__":
    main()
