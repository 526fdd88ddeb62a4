"""hcjax.data package."""
