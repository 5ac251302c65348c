"""DeepSeek-V2 / V3 (HF directories only): MLA attention (model/mla.py), dense layers only."""

from hicache.model.families.base import Family

DEEPSEEK = Family("deepseek", None, ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"))
