"""hcjax.transfer package."""
