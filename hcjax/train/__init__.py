"""hcjax.train package: the one train step that SFT, DPO and RL share (`hcjax.train.step`)."""
