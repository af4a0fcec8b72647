"""hf_relpos: relative-position attention schemes as Hugging Face Transformers models.

``import hf_relpos`` registers ``RelPosConfig`` and the model classes with the Auto classes, and warns in one line
when the installed Transformers is outside the tested range (``hf_relpos.versions``).
"""

import logging

import transformers
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
from .transfo_xl_conversion import from_transfo_xl
from .versions import untested_transformers_warning

__version__ = "0.2.0"

if (_warning := untested_transformers_warning(transformers.__version__)) is not None:
    logging.getLogger(__name__).warning(_warning)  # one line on stderr by default; silenced by logging settings

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
    "from_transfo_xl",
    "POSITION_ENCODINGS",
    "POSITION_SCHEMES",
]
