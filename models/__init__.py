"""The native model (its families' config readers, converters and builders are in ``waypoint.families``)."""

from waypoint.models.dtypes import DTYPE_NAMES, hf_config_dtype, parse_dtype
from waypoint.models.args import ModelArgs
from waypoint.models.transformer import Transformer

__all__ = ["DTYPE_NAMES", "ModelArgs", "Transformer", "hf_config_dtype", "parse_dtype"]
