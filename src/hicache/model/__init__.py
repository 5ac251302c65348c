"""Llama-family model, tokenizer and loaders. The engine imports from here only."""

from hicache.model.batch import DenseKV, ForwardBatch, KVView
from hicache.model.errors import ModelFormatError, ModelNotFoundError
from hicache.model.llama import LlamaForCausalLM
from hicache.model.loader import LoadedModel, load_model
from hicache.model.paged import make_forward_batch
from hicache.model.spec import ModelSpec, ModelSpecError
from hicache.model.tokenizer import Tokenizer

__all__ = ["DenseKV", "ForwardBatch", "KVView", "LlamaForCausalLM", "LoadedModel", "ModelFormatError",
           "ModelNotFoundError", "ModelSpec", "ModelSpecError", "Tokenizer", "load_model", "make_forward_batch"]
