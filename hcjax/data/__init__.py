"""hcjax.data package: tokenizers, templates, task sources, packing and the SFT input pipeline."""

from hcjax.data.tasks import ArithmeticSuite, Problem
from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ArithmeticSuite", "ByteTokenizer", "HFTokenizer", "Problem", "load_tokenizer"]
