"""hcjax.rewards package."""
