"""hcjax.envs package."""
