"""hcjax.rollout package."""
