"""hcjax.rl package."""
