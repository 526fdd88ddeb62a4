"""hcjax.data package: tokenizers, templates, the problem record, readers, packing and the SFT
input pipeline."""

from hcjax.data.problem import TaskProblem
from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "TaskProblem", "load_tokenizer"]
