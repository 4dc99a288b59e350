"""The typed, frozen config tree of deepinfer_jax and its loaders.

The tree (:class:`EngineConfig`) holds the parsed HF model config (:class:`ModelConfig`, one subclass per
family) and one section per engine concern: :class:`CacheConfig`, :class:`ParallelConfig`,
:class:`SchedulerConfig`, :class:`SpeculativeConfig`, :class:`SamplingConfig`, :class:`OpsConfig`. Every node is
a frozen, hashable dataclass validated on construction (so ``dataclasses.replace`` re-validates).

Sources, lowest to highest priority: defaults < HF ``config.json`` < yaml < gin < ``DEEPINFER_*`` environment
< keyword overrides / absl flags. See :func:`load_config` and docs/config.md.
"""

from deepinfer_jax.config.env import ENV_VARS, PROJECT_ENV_VARS, read_env
from deepinfer_jax.config.errors import ConfigTypeError, ConfigValueError, ConfigWarning
from deepinfer_jax.config.frozen import FrozenMapping, freeze, thaw
from deepinfer_jax.config.ginparse import GinBinding, parse_gin
from deepinfer_jax.config.loaders import (
    YAML_SECTIONS,
    load_config,
    load_config_with_sources,
    load_model_config,
    load_yaml,
    parse_overrides,
)
from deepinfer_jax.config.model import (
    MODEL_FAMILIES,
    ModelConfig,
    QuantizationConfig,
    RopeConfig,
    parse_hf_config,
)
from deepinfer_jax.config.sweep import SweepPoint, SweepSpec, load_sweep
from deepinfer_jax.config.tree import (
    BLOCK_SIZES,
    KV_CACHE_DTYPES,
    OPS_BACKENDS,
    SECTIONS,
    CacheConfig,
    EngineConfig,
    OpsConfig,
    ParallelConfig,
    SamplingConfig,
    SchedulerConfig,
    SpeculativeConfig,
    config_to_dict,
)
from deepinfer_jax.config.v3 import DeepseekV3Config
from deepinfer_jax.config.v4 import DeepseekV4BaseConfig, DeepseekV4Config
from deepinfer_jax.config.v41 import DeepseekV41Config

__all__ = [
    "BLOCK_SIZES",
    "ENV_VARS",
    "KV_CACHE_DTYPES",
    "MODEL_FAMILIES",
    "OPS_BACKENDS",
    "PROJECT_ENV_VARS",
    "SECTIONS",
    "YAML_SECTIONS",
    "CacheConfig",
    "ConfigTypeError",
    "ConfigValueError",
    "ConfigWarning",
    "DeepseekV3Config",
    "DeepseekV4BaseConfig",
    "DeepseekV4Config",
    "DeepseekV41Config",
    "EngineConfig",
    "FrozenMapping",
    "GinBinding",
    "ModelConfig",
    "OpsConfig",
    "ParallelConfig",
    "QuantizationConfig",
    "RopeConfig",
    "SamplingConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "SweepPoint",
    "SweepSpec",
    "config_to_dict",
    "freeze",
    "load_config",
    "load_config_with_sources",
    "load_model_config",
    "load_sweep",
    "load_yaml",
    "parse_gin",
    "parse_hf_config",
    "parse_overrides",
    "read_env",
    "thaw",
]
