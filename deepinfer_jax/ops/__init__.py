"""Hot ops: one reference (``jnp``/``lax``) implementation each, plus per-backend alternatives chosen at trace time.

Importing this package registers every op in :data:`default_registry`; model code selects implementations with
:func:`select` / :func:`select_from` (or calls them through :func:`call`) instead of branching on the platform.
See ``docs/ops.md``.
"""

import custom_calls.cutedsl as _cutedsl
from deepinfer_jax.ops import (  # noqa: F401  (registers the ops)
    gemm,
    grouped_gemm,
    indexer,
    kv_store,
    moe_kernels,
    sparse_attention,
    swiglu,
)
from deepinfer_jax.ops.registry import (
    AUTO,
    KNOWN_BACKENDS,
    KNOWN_PLATFORMS,
    REFERENCE,
    BackendUnavailableError,
    OpRegistry,
    Selected,
    call,
    default_registry,
    describe,
    get,
    list_ops,
    normalize_platform,
    register_impl,
    register_op,
    select,
    select_from,
)
from deepinfer_jax.ops.rmsnorm import rms_norm
from deepinfer_jax.ops.rope import (
    RopeParams,
    YarnParams,
    apply_rope,
    rope_cos_sin,
    rope_frequencies,
    yarn_correction_range,
    yarn_magnitude,
    yarn_mscale,
    yarn_softmax_scale_correction,
)
from deepinfer_jax.ops.selection import (
    OpChoice,
    OpSelection,
    active_selection,
    bind_selection,
    resolve_selection,
    use_selection,
)

# CuteDSL (SM100) implementations are registered by lazy "module:attr" reference: importing this small package
# loads neither JAX kernels nor the CuteDSL toolchain, and each one's `available()` check keeps it off every
# machine that is not a configured SM100 GPU (docs/backends.md).
_cutedsl.register(default_registry)

__all__ = [
    "AUTO",
    "KNOWN_BACKENDS",
    "KNOWN_PLATFORMS",
    "REFERENCE",
    "BackendUnavailableError",
    "OpChoice",
    "OpRegistry",
    "OpSelection",
    "RopeParams",
    "Selected",
    "YarnParams",
    "active_selection",
    "apply_rope",
    "bind_selection",
    "call",
    "default_registry",
    "describe",
    "get",
    "list_ops",
    "normalize_platform",
    "register_impl",
    "register_op",
    "resolve_selection",
    "rms_norm",
    "rope_cos_sin",
    "rope_frequencies",
    "select",
    "select_from",
    "use_selection",
    "yarn_correction_range",
    "yarn_magnitude",
    "yarn_mscale",
    "yarn_softmax_scale_correction",
]
