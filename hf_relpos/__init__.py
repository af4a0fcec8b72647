"""hf_relpos: relative-position attention schemes as Hugging Face Transformers models.

``import hf_relpos`` registers ``RelPosConfig`` and the four model classes with the Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

from . import functional
from .configuration_relpos import POSITION_ENCODINGS, RelPosConfig
from .modeling_relpos import (
    POSITION_SCHEMES,
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosForSequenceClassification,
    RelPosModel,
    RelPosPreTrainedModel,
)

from .t5_conversion import from_t5

__version__ = "0.1.0"

AutoConfig.register("relpos", RelPosConfig, exist_ok=True)
AutoModel.register(RelPosConfig, RelPosModel, exist_ok=True)
AutoModelForCausalLM.register(RelPosConfig, RelPosForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(RelPosConfig, RelPosForSequenceClassification, exist_ok=True)
AutoModelForSeq2SeqLM.register(RelPosConfig, RelPosForConditionalGeneration, exist_ok=True)

__all__ = [
    "functional",
    "RelPosConfig",
    "RelPosModel",
    "RelPosForCausalLM",
    "RelPosForSequenceClassification",
    "RelPosForConditionalGeneration",
    "RelPosPreTrainedModel",
    "from_t5",
    "POSITION_ENCODINGS",
    "POSITION_SCHEMES",
]
