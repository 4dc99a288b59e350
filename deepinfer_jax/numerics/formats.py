"""Element codes, scale codes and layout descriptions of every quantised format DeepSeek models use.

This module is deliberately free of JAX: the descriptions here (constants, value tables, the
:class:`QuantScheme` and :class:`RecordFormat` objects) are shared by the ``jnp`` codecs that run inside
jitted model code and by the ``numpy``/``ml_dtypes`` host codecs in :mod:`deepinfer_jax.numerics.host`
that write synthetic checkpoints and convert weights offline. Keeping them in one place is what lets the
two implementations agree bit for bit.

Formats (``spec/model.md`` §12):

* **E4M3** (OCP ``float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits, subnormals, largest
  finite value 448, no infinities; ``0x7F``/``0xFF`` are NaN.
* **E2M1** (FP4): 4-bit code ``s b b b``; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN, no infinity.
  Two codes per byte, element ``2i`` in the low nibble.
* **UE8M0**: an unsigned biased exponent byte ``b`` meaning ``2^(b - 127)``; ``0xFF`` is NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Final, Literal

# ----------------------------------------------------------------------------------------------------
# Element and scale constants
# ----------------------------------------------------------------------------------------------------

E4M3_MAX: Final = 448.0
"""Largest finite E4M3 magnitude (``0x7E``)."""
E4M3_MIN_SUBNORMAL: Final = 2.0**-9
"""Smallest positive E4M3 value (code ``0x01``)."""
E4M3_NAN_CODE: Final = 0x7F
"""The E4M3 NaN byte this library writes (positive sign)."""

E2M1_MAX: Final = 6.0
"""Largest E2M1 magnitude (code ``0b0111``)."""
E2M1_MAGNITUDES: Final = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes indexed by the low three bits of a code."""
E2M1_VALUES: Final = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
"""E2M1 values indexed by the full 4-bit code (bit 3 is the sign; code 8 is negative zero)."""

UE8M0_BIAS: Final = 127
UE8M0_NAN_CODE: Final = 0xFF
UE8M0_MAX_EXPONENT: Final = 127
UE8M0_MIN_EXPONENT: Final = -127

F32_MIN_NORMAL: Final = 2.0**-126
"""Values of smaller magnitude are float32 subnormals; the codecs flush them to signed zero (see docs)."""

# amax margins of §12: they keep every scale finite and non-zero, so all-zero groups are well defined.
E4M3_AMAX_MARGIN: Final = 1e-4
"""E4M3 groups (FP8 weights, MXFP8 activations and window KV, V3 activations) clamp ``amax >= 1e-4``."""
E2M1_UE8M0_AMAX_MARGIN: Final = E2M1_MAX * F32_MIN_NORMAL
"""MXFP4 groups clamp ``amax >= 6 * 2^-126``, so the smallest scale is ``2^-126`` (byte 1)."""
FP4_E4M3_AMAX_MARGIN: Final = E2M1_MAX * E4M3_MIN_SUBNORMAL
"""FP4 groups with E4M3 scales clamp ``amax >= 6 * 2^-9``, so the smallest scale is E4M3 ``2^-9``."""

ElementName = Literal["e4m3", "e2m1", "bf16"]
ScaleName = Literal["ue8m0", "e4m3", "float32"]

_ELEMENT_BITS: Final[dict[str, int]] = {"e4m3": 8, "e2m1": 4, "bf16": 16}
_ELEMENT_MAX: Final[dict[str, float]] = {"e4m3": E4M3_MAX, "e2m1": E2M1_MAX}
_SCALE_BYTES: Final[dict[str, int]] = {"ue8m0": 1, "e4m3": 1, "float32": 4}


def _require_int(field: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


# ----------------------------------------------------------------------------------------------------
# Group quantisation schemes
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How one group of ``group_size`` consecutive values is quantised: element code plus one scale.

    ``scale`` selects the scale rule:

    * ``"ue8m0"`` -- power-of-two scale ``2^ceil(log2(amax / Qmax))`` (MX formats, V4/V4.1 weights).
    * ``"e4m3"`` -- E4M3 scale ``e4m3(min(amax / 6, 448))`` (the FP4 compressed-KV format; E2M1 only).
    * ``"float32"`` -- float32 ``scale_inv = amax / 448`` (DeepSeek-V3 FP8 weights and activations; E4M3 only).
    """

    element: ElementName
    scale: ScaleName
    group_size: int

    def __post_init__(self) -> None:
        if self.element not in ("e4m3", "e2m1"):
            raise ValueError(f"QuantScheme.element must be 'e4m3' or 'e2m1', got {self.element!r}")
        if self.scale not in _SCALE_BYTES:
            raise ValueError(f"QuantScheme.scale must be one of {sorted(_SCALE_BYTES)}, got {self.scale!r}")
        if self.scale == "e4m3" and self.element != "e2m1":
            raise ValueError("QuantScheme.scale 'e4m3' is defined only for element 'e2m1' (FP4 KV records)")
        if self.scale == "float32" and self.element != "e4m3":
            raise ValueError("QuantScheme.scale 'float32' is defined only for element 'e4m3' (V3 FP8)")
        _require_int("QuantScheme.group_size", self.group_size)
        if self.element == "e2m1" and self.group_size % 2:
            raise ValueError(
                f"QuantScheme.group_size must be even for packed e2m1 codes, got {self.group_size}"
            )

    @property
    def qmax(self) -> float:
        """Largest element magnitude (448 for E4M3, 6 for E2M1)."""
        return _ELEMENT_MAX[self.element]

    @property
    def amax_margin(self) -> float:
        """Lower clamp of a group's ``amax`` (§12); makes the scale of an all-zero group finite."""
        if self.element == "e4m3":
            return E4M3_AMAX_MARGIN
        return E2M1_UE8M0_AMAX_MARGIN if self.scale == "ue8m0" else FP4_E4M3_AMAX_MARGIN

    @property
    def element_bits(self) -> int:
        return _ELEMENT_BITS[self.element]

    @property
    def scale_itemsize(self) -> int:
        return _SCALE_BYTES[self.scale]


MXFP8: Final = QuantScheme("e4m3", "ue8m0", 32)
"""E4M3 codes, one UE8M0 scale per 32 values: window KV, V4/V4.1 activation cast, Engram rows."""
MXFP4: Final = QuantScheme("e2m1", "ue8m0", 32)
"""E2M1 codes, one UE8M0 scale per 32 values: routed experts, indexer keys and queries."""
FP4_E4M3_16: Final = QuantScheme("e2m1", "e4m3", 16)
"""E2M1 codes, one E4M3 scale per 16 values, no global scale: the compressed-KV cache."""


def fp8_block_scheme(scale_fmt: str, block_elements: int) -> QuantScheme:
    """The E4M3 scheme of a block-scaled FP8 weight (``"ue8m0"`` for V4/V4.1, ``"float32"`` for V3)."""
    if scale_fmt not in ("ue8m0", "float32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'float32', got {scale_fmt!r}")
    return QuantScheme("e4m3", scale_fmt, block_elements)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# Per-token KV record formats
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """Byte layout of one token's cache record: ``[code bytes][scale bytes]``, token-contiguous.

    The cache code sizes pages generically from :attr:`record_bytes`, which is derived from the layout
    (element width, group size, scale width), never written down as a constant. ``scale`` is ``None``
    for unquantised records (the DeepSeek-V3 bf16 latent), whose code bytes are little-endian bf16.
    """

    name: str
    num_elements: int
    element: ElementName
    scale: ScaleName | None
    group_size: int

    def __post_init__(self) -> None:
        _require_int(f"RecordFormat({self.name!r}).num_elements", self.num_elements)
        if self.element not in _ELEMENT_BITS:
            raise ValueError(
                f"RecordFormat({self.name!r}).element must be one of {sorted(_ELEMENT_BITS)}, "
                f"got {self.element!r}"
            )
        if self.element == "bf16":
            if self.scale is not None or self.group_size != 0:
                raise ValueError(f"RecordFormat({self.name!r}): bf16 records take no scale and group_size 0")
            return
        scheme = QuantScheme(self.element, self.scale, self.group_size)  # type: ignore[arg-type]
        if self.num_elements % scheme.group_size:
            raise ValueError(
                f"RecordFormat({self.name!r}).num_elements must be a multiple of group_size "
                f"{scheme.group_size}, got {self.num_elements}"
            )

    @property
    def scheme(self) -> QuantScheme:
        """The group quantisation scheme of the record (not defined for bf16 records)."""
        if self.element == "bf16":
            raise ValueError(f"RecordFormat({self.name!r}) is unquantised (bf16) and has no scheme")
        return QuantScheme(self.element, self.scale, self.group_size)  # type: ignore[arg-type]

    @property
    def quantized(self) -> bool:
        return self.element != "bf16"

    @property
    def code_bytes(self) -> int:
        """Bytes of element codes (packed two per byte for E2M1)."""
        return self.num_elements * _ELEMENT_BITS[self.element] // 8

    @property
    def num_scales(self) -> int:
        return 0 if self.scale is None else self.num_elements // self.group_size

    @property
    def scale_bytes(self) -> int:
        return 0 if self.scale is None else self.num_scales * _SCALE_BYTES[self.scale]

    @property
    def record_bytes(self) -> int:
        """Bytes per token: code bytes followed by scale bytes."""
        return self.code_bytes + self.scale_bytes


def mxfp8_record_format(num_elements: int, name: str = "mxfp8") -> RecordFormat:
    """MXFP8 record: ``num_elements`` E4M3 bytes then one UE8M0 byte per 32 (528 B at 512)."""
    return RecordFormat(name, num_elements, "e4m3", "ue8m0", 32)


def fp4_e4m3_record_format(num_elements: int, name: str = "fp4_e4m3") -> RecordFormat:
    """FP4 record: packed E2M1 codes then one E4M3 scale per 16, no global scale (288 B at 512)."""
    return RecordFormat(name, num_elements, "e2m1", "e4m3", 16)


def mxfp4_record_format(num_elements: int, name: str = "mxfp4") -> RecordFormat:
    """MXFP4 record: packed E2M1 codes then one UE8M0 byte per 32 (68 B at 128)."""
    return RecordFormat(name, num_elements, "e2m1", "ue8m0", 32)


def bf16_record_format(num_elements: int, name: str = "bf16") -> RecordFormat:
    """Unquantised record: ``num_elements`` little-endian bf16 values (1152 B at 512 + 64)."""
    return RecordFormat(name, num_elements, "bf16", None, 0)


def window_record_format(head_dim: int) -> RecordFormat:
    """Sliding-window KV record of V4/V4.1 (§12.3.1): MXFP8 over the whole ``head_dim`` vector."""
    return mxfp8_record_format(head_dim, name="window")


def compressed_record_format(head_dim: int, use_fp4: bool = True) -> RecordFormat:
    """Compressed-KV record (§12.3.2): FP4 with E4M3 per-16 scales, or MXFP8 when ``use_fp4`` is false."""
    if use_fp4:
        return fp4_e4m3_record_format(head_dim, name="compressed")
    return mxfp8_record_format(head_dim, name="compressed")


def indexer_record_format(index_head_dim: int) -> RecordFormat:
    """Indexer-key record (§12.3.3): MXFP4 over ``index_head_dim`` values (pages are block-sectioned)."""
    return mxfp4_record_format(index_head_dim, name="indexer")


def latent_record_format(kv_lora_rank: int, qk_rope_head_dim: int) -> RecordFormat:
    """DeepSeek-V3 MLA cache record: bf16 ``[latent | rope]`` (§16)."""
    return bf16_record_format(kv_lora_rank + qk_rope_head_dim, name="latent")
