"""hcjax.distill package."""
