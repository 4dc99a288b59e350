"""Engram: hashed n-gram memory of DeepSeek-V4.1 (spec/model.md §9, §12.1.3, §13.3).

In each Engram layer, every token looks up rows of a large FP8 table addressed by hashes of the n-grams that end
at it (orders ``2..Nmax``, ``Ne`` hash heads per order), projects the concatenated rows to ``m + 1`` vectors of
width ``H`` (one key per hyper-connection stream and one shared value) and adds the value to each stream behind
a per-stream sigmoid gate. The pieces, in the order a forward uses them:

1. **Compression map** (§9.1, host): raw token id -> compressed id, from ``tokenizer.json`` (decode each token,
   fold case/accents/whitespace, first-seen numbering) or from an explicit table. :class:`CompressionMap`.
2. **Layout** (§9.3, host, static): per layer the table sizes (distinct primes), row offsets and odd 64-bit
   multipliers drawn from NumPy's PCG64 seeded by the backbone layer id. :class:`EngramLayout`.
3. **N-gram ids** (§9.2, device): the current and previous ``Nmax - 1`` compressed ids, padded with the
   compressed pad id, carried across chunks. :func:`ngram_ids`.
4. **Rows** (§9.3, device): ``h_n = h_{n-1} XOR (c_{p-n+1} · mult[n-1])`` in 64-bit arithmetic, ``row = h_n mod
   P + offset``. :func:`hash_rows`.
5. **Embedding, projection, gate** (§9.4, device): :func:`engram_embed`, :func:`engram_gate`,
   :func:`engram_layer`.

Why the hash is computed with 32-bit limbs: JAX runs with 32-bit integers unless ``jax_enable_x64`` is set
process-wide, and the engine must not depend on that flag. The products ``c · mult`` are below ``2^63`` by the
choice of ``bound`` (§9.3), so a (high, low) pair of ``uint32`` holds them exactly; XOR works limb by limb, and
``h mod P`` for a prime ``P < 2^31`` is reduced bit by bit (``r = 2r + bit``, minus ``P`` when it overflows),
which never leaves ``uint32``. The result is bit-identical to NumPy's ``int64`` arithmetic.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as _HFTokenizer

from deepinfer_jax.config.errors import ConfigValueError
from deepinfer_jax.config.v41 import DeepseekV41Config
from deepinfer_jax.models.common.linear import LinearNumerics, linear
from deepinfer_jax.numerics.elements import e4m3_decode, ue8m0_decode

__all__ = [
    "MAX_TABLE_ROWS",
    "CompressionMap",
    "EngramLayout",
    "engram_embed",
    "engram_embed_dense",
    "engram_gate",
    "engram_key",
    "engram_layer",
    "engram_multipliers",
    "engram_table_sizes",
    "hash_rows",
    "next_prime",
    "ngram_ids",
]

MAX_TABLE_ROWS = 2**31 - 1
"""Most rows one layer's table may have: rows are ``int32`` and every prime stays below ``2^31`` (the 32-bit-limb
hash needs that); real tables have a few hundred million rows."""
_SCALE_GROUP = 32  # §12.1.3: one UE8M0 scale per row per 32 columns
_SEED_STRIDE = 10007  # §9.3: layer l draws from default_rng(seed + 10007 * l)
_GATE_CLAMP = 1e-6  # §9.4: sqrt(max(|dot|, 1e-6))
_SENTINEL = "\ue000"  # §9.1: a private-use character that stands for a lone space through Strip()


# ----------------------------------------------------------------------------------- 1. compression map


@functools.cache
def _normalizer() -> normalizers.Normalizer:
    # The §9.1 pipeline. It is built from the tokenizers library's own normalizers because the compressed ids
    # must match the ones the checkpoint was trained with, and those came from this library: Python's
    # unicodedata may carry another Unicode version, and str.lower / str.strip differ from Rust's on a few
    # code points.
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def engram_key(decoded: str, raw_token: str) -> str:
    """The §9.1 key of one token: its normalised text, or the raw vocabulary string for invalid UTF-8 pieces.

    A token whose decoded text holds U+FFFD is a partial UTF-8 sequence; keying it by its (distinct) raw
    spelling keeps different byte pieces apart. Text that normalises to nothing keeps its decoded form.
    """
    if "\ufffd" in decoded:
        return raw_token
    return _normalizer().normalize_str(decoded) or decoded


def _hf_tokenizer(tokenizer: Any) -> _HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a path, a ``tokenizers.Tokenizer``, or a wrapper exposing ``.backend``."""
    if isinstance(tokenizer, str | os.PathLike):
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer = {str(tokenizer)!r}: no tokenizer.json there")
        return _HFTokenizer.from_file(str(path))
    if isinstance(tokenizer, _HFTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend", None)
    if isinstance(backend, _HFTokenizer):
        return backend
    raise TypeError(
        "tokenizer: expected a tokenizer.json path, a tokenizers.Tokenizer or an object with a tokenizers "
        f"`backend`, got {type(tokenizer).__name__}"
    )


@dataclass(frozen=True, eq=False)
class CompressionMap:
    """Raw token id -> compressed id (§9.1).

    Attributes:
        table: ``int32 [vocab]``; ``table[raw_id]`` is the compressed id, dense in ``[0, size)``.
        size: ``Vc``, the number of distinct compressed ids.
        source: where the map came from (for messages).
    """

    table: np.ndarray
    size: int
    source: str

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> CompressionMap:
        """Build the map from a tokenizer: every id in order, decoded alone with special tokens kept (§9.1)."""
        hf = _hf_tokenizer(tokenizer)
        keys: dict[str, int] = {}
        table = np.empty(hf.get_vocab_size(), np.int32)
        for token_id in range(table.size):
            decoded = hf.decode([token_id], skip_special_tokens=False)
            raw = hf.id_to_token(token_id)
            if raw is None:
                raise ValueError(f"tokenizer: id {token_id} has no vocabulary entry (ids must be dense)")
            table[token_id] = keys.setdefault(engram_key(decoded, raw), len(keys))
        source = str(tokenizer) if isinstance(tokenizer, str | os.PathLike) else "tokenizer"
        return cls(table=table, size=len(keys), source=source)

    @classmethod
    def from_table(
        cls, table: Sequence[int] | np.ndarray, *, source: str = "explicit table"
    ) -> CompressionMap:
        """Use an explicit table (e.g. the identity, to reproduce §15.2's example multipliers with ``Vc = 512``).

        The values must be non-negative integers that use every id in ``[0, max]`` (dense), as a tokenizer-built
        map does; ``Vc = max + 1``.
        """
        arr = np.asarray(table)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(
                f"compression table ({source}): expected a non-empty 1-D integer array, got dtype {arr.dtype} "
                f"shape {arr.shape}"
            )
        if arr.min() < 0:
            raise ValueError(
                f"compression table ({source}): value {int(arr.min())} is negative; must be >= 0"
            )
        size = int(arr.max()) + 1
        if size > MAX_TABLE_ROWS:
            raise ValueError(f"compression table ({source}): {size} ids; must be <= {MAX_TABLE_ROWS}")
        if np.unique(arr).size != size:
            raise ValueError(
                f"compression table ({source}): uses {np.unique(arr).size} distinct ids but its maximum is "
                f"{size - 1}; compressed ids must be dense in [0, max]"
            )
        return cls(table=arr.astype(np.int32), size=size, source=source)

    def __call__(self, raw_ids: Any) -> np.ndarray:
        """Map raw ids on the host (validating them)."""
        ids = np.asarray(raw_ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.table.size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"raw token id {bad}: outside [0, {self.table.size}) of the compression map")
        return self.table[ids]


# --------------------------------------------------------------------------------------------- 2. layout


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin; these bases are exact for every n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """The smallest prime strictly greater than ``n``."""
    candidate = max(n + 1, 2)
    while not _is_prime(candidate):
        candidate += 1
    return candidate


def engram_table_sizes(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per layer (config order), per order ``n = 2..Nmax``, per head: the table size ``P_l[n][j]`` (§9.3).

    Each order starts again from ``vocab_size - 1``; a size is the next prime above the running start that no
    earlier (layer, order, head) has taken, and becomes the new start. They depend on nothing else.
    """
    used: set[int] = set()
    out = []
    for _ in layer_ids:
        orders = []
        for _ in range(2, max_ngram_size + 1):
            start, heads = vocab_size - 1, []
            for _ in range(n_heads):
                prime = next_prime(start)
                while prime in used:
                    prime = next_prime(prime)
                used.add(prime)
                heads.append(prime)
                start = prime
            orders.append(tuple(heads))
        out.append(tuple(orders))
    return tuple(out)


def engram_multipliers(
    layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int, seed: int = 0
) -> tuple[tuple[int, ...], ...]:
    """Per layer: ``Nmax`` odd multipliers, ``default_rng(seed + 10007·l).integers(0, bound) · 2 + 1`` (§9.3).

    ``bound = max(1, (2^63 - 1) // Vc // 2)`` keeps every product ``c · mult`` (``c < Vc``) below ``2^63``.
    """
    if compressed_vocab_size < 1:
        raise ValueError(f"compressed_vocab_size = {compressed_vocab_size}: must be >= 1")
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    out = []
    for layer in layer_ids:
        rng = np.random.default_rng(seed + _SEED_STRIDE * int(layer))
        draws = rng.integers(0, bound, size=max_ngram_size, dtype=np.int64) * 2 + 1
        out.append(tuple(int(v) for v in draws))
    return tuple(out)


@dataclass(frozen=True)
class EngramLayout:
    """The static Engram layout of a model (hashable: a ``jax.jit`` static argument).

    Attributes:
        layer_ids: Engram layers, config order.
        max_ngram_size: ``Nmax``; tables exist for orders ``2..Nmax``.
        n_heads, head_dim: ``Ne`` hash heads per order, ``De`` columns per table row.
        compressed_vocab_size: ``Vc``.
        pad_id: the compressed id of ``engram_pad_token_id`` (fills history before a sequence's start).
        sizes: ``[layer][order - 2][head]`` table sizes (primes).
        multipliers: ``[layer][Nmax]`` odd 64-bit multipliers.
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    compressed_vocab_size: int
    pad_id: int
    sizes: tuple[tuple[tuple[int, ...], ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @classmethod
    def from_config(cls, cfg: DeepseekV41Config, compression: CompressionMap) -> EngramLayout:
        """Derive the layout and check it against the config's ``engram_compressed_vocab_size`` and
        ``engram_num_embeddings`` when they are given (§2.7: every multiplier depends on ``Vc``; the checkpoint
        tables have exactly ``Σ P_l`` rows).
        """
        if not cfg.engram_enabled:
            raise ValueError("EngramLayout.from_config: the config has no engram_layer_ids (Engram is off)")
        cfg.require_complete("building the Engram layout")
        assert cfg.engram_max_ngram_size and cfg.engram_n_heads and cfg.engram_head_dim
        assert cfg.engram_vocab_size and cfg.engram_pad_token_id is not None
        where = f" (in {cfg.source})" if cfg.source else ""
        if compression.table.size != cfg.vocab_size:
            raise ValueError(
                f"compression map ({compression.source}) covers {compression.table.size} raw ids; the model's "
                f"text_config.vocab_size is {cfg.vocab_size}{where}"
            )
        vc = compression.size
        if cfg.engram_compressed_vocab_size is not None and cfg.engram_compressed_vocab_size != vc:
            key = "text_config.engram_compressed_vocab_size"
            raise ConfigValueError(
                f"{key} = {cfg.engram_compressed_vocab_size}: the compression map ({compression.source}) has "
                f"{vc} ids; they must be equal (every hash multiplier depends on it){where}",
                field=key,
            )
        if cfg.engram_head_dim % _SCALE_GROUP:
            key = "text_config.engram_head_dim"
            raise ConfigValueError(
                f"{key} = {cfg.engram_head_dim}: must be a multiple of {_SCALE_GROUP} (one UE8M0 scale per 32 "
                f"columns){where}",
                field=key,
            )
        sizes = engram_table_sizes(
            cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size
        )
        rows = max(sum(sum(order) for order in layer) for layer in sizes)
        if rows > MAX_TABLE_ROWS:
            key = "text_config.engram_vocab_size"
            raise ConfigValueError(
                f"{key} = {cfg.engram_vocab_size}: gives a table of {rows} rows; one layer's table must have "
                f"<= {MAX_TABLE_ROWS} rows{where}",
                field=key,
            )
        layout = cls(
            layer_ids=cfg.engram_layer_ids,
            max_ngram_size=cfg.engram_max_ngram_size,
            n_heads=cfg.engram_n_heads,
            head_dim=cfg.engram_head_dim,
            compressed_vocab_size=vc,
            pad_id=int(compression.table[cfg.engram_pad_token_id]),
            sizes=sizes,
            multipliers=engram_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size, vc),
        )
        if cfg.engram_num_embeddings is not None and cfg.engram_num_embeddings != layout.num_rows:
            key = "text_config.engram_num_embeddings"
            raise ConfigValueError(
                f"{key} = {list(cfg.engram_num_embeddings)!r}: the table sizes of engram_vocab_size = "
                f"{cfg.engram_vocab_size} give {list(layout.num_rows)!r} rows; they must be equal{where}",
                field=key,
            )
        return layout

    @property
    def num_orders(self) -> int:
        return self.max_ngram_size - 1

    @property
    def num_rows(self) -> tuple[int, ...]:
        """``Σ P_l`` per layer: the row count of each layer's table."""
        return tuple(sum(sum(order) for order in layer) for layer in self.sizes)

    @property
    def embed_width(self) -> int:
        """``(Nmax - 1) · Ne · De``, the width of the concatenated rows (``engram.wkv``'s input)."""
        return self.num_orders * self.n_heads * self.head_dim

    def offsets(self, slot: int) -> tuple[tuple[int, ...], ...]:
        """Exclusive prefix sums of layer ``slot``'s sizes in (order, head) order."""
        flat = [p for order in self.sizes[slot] for p in order]
        starts = np.concatenate([[0], np.cumsum(flat)[:-1]]).tolist()
        return tuple(tuple(starts[o * self.n_heads : (o + 1) * self.n_heads]) for o in range(self.num_orders))

    def slot(self, layer: int) -> int:
        """Position of backbone ``layer`` in :attr:`layer_ids`."""
        if layer not in self.layer_ids:
            raise ValueError(
                f"layer = {layer}: not an Engram layer; Engram layers are {list(self.layer_ids)}"
            )
        return self.layer_ids.index(layer)


# ------------------------------------------------------------------------------------------ 3. n-gram ids


def ngram_ids(
    compressed: jax.Array, history: jax.Array | None, *, max_ngram_size: int, pad_id: int
) -> tuple[jax.Array, jax.Array]:
    """``ng[..., p, r] = c_{p-r}`` for ``r = 0..Nmax-1`` (§9.2), and the history to carry to the next chunk.

    Args:
        compressed: ``[..., S]`` compressed ids of a chunk of consecutive tokens of each sequence.
        history: ``[..., Nmax-1]`` the compressed ids of the ``Nmax-1`` tokens before the chunk, oldest first,
            ``pad_id`` where the sequence had not started; ``None`` = the chunk starts its sequences.
        max_ngram_size: ``Nmax``.
        pad_id: compressed pad id.

    Returns:
        ``(ngrams [..., S, Nmax] int32, new_history [..., Nmax-1] int32)``. Feeding ``new_history`` into the
        next call makes chunked prefill and token-by-token decode give the same ids as one pass.
    """
    c = jnp.asarray(compressed, jnp.int32)
    depth = max_ngram_size - 1
    if history is None:
        history = jnp.full((*c.shape[:-1], depth), pad_id, jnp.int32)
    history = jnp.asarray(history, jnp.int32)
    if history.shape != (*c.shape[:-1], depth):
        raise ValueError(f"history: expected shape {(*c.shape[:-1], depth)}, got {history.shape}")
    full = jnp.concatenate([history, c], axis=-1)
    S = c.shape[-1]
    grams = jnp.stack([full[..., depth - r : depth - r + S] for r in range(max_ngram_size)], axis=-1)
    return grams, full[..., full.shape[-1] - depth :]


# ---------------------------------------------------------------------------------------------- 4. rows


def _mul_u32(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Full 64-bit product of two ``uint32`` arrays as ``(high, low)`` limbs, from 16-bit halves."""
    mask = jnp.uint32(0xFFFF)
    a0, a1 = a & mask, a >> 16
    b0, b1 = b & mask, b >> 16
    p00 = a0 * b0
    m1 = a0 * b1 + (p00 >> 16)  # < 2^32: (2^16-1)^2 + 2^16 - 1
    m2 = a1 * b0 + (m1 & mask)
    low = (m2 << 16) | (p00 & mask)
    high = a1 * b1 + (m1 >> 16) + (m2 >> 16)
    return high, low


def _mod_u64(high: jax.Array, low: jax.Array, primes: jax.Array) -> jax.Array:
    """``(high · 2^32 + low) mod primes`` (broadcasting) for primes ``< 2^31``, in ``uint32`` only.

    Horner's rule over the 32 bits of ``low``: ``r < P`` keeps ``2r + 1 < 2^32``, and one conditional
    subtraction brings ``r`` back below ``P`` after each bit.
    """
    r = high % primes

    def step(i: jax.Array, r: jax.Array) -> jax.Array:
        bit = (low >> (jnp.uint32(31) - i.astype(jnp.uint32))) & jnp.uint32(1)
        r = (r << 1) | bit
        return jnp.where(r >= primes, r - primes, r)

    return lax.fori_loop(0, 32, step, r)


def hash_rows(ngrams: jax.Array, layout: EngramLayout, slot: int) -> jax.Array:
    """Table rows of layer ``slot`` (position in ``layout.layer_ids``) for n-gram ids ``[..., Nmax]`` (§9.3).

    Returns ``int32 [..., Nmax-1, Ne]``: ``row[..., n-2, j] = (h_n mod P[n][j]) + off[n][j]``.
    """
    grams = jnp.asarray(ngrams).astype(jnp.uint32)
    if grams.shape[-1] != layout.max_ngram_size:
        raise ValueError(f"ngrams: last axis must be Nmax = {layout.max_ngram_size}, got shape {grams.shape}")
    mult = np.asarray(layout.multipliers[slot], np.uint64)
    ph, pl = _mul_u32(grams, jnp.asarray((mult & 0xFFFFFFFF).astype(np.uint32)))
    ph = ph + grams * jnp.asarray((mult >> 32).astype(np.uint32))  # wraps mod 2^32; products are < 2^63
    # h_n = h_{n-1} XOR product_{n-1}: a running XOR along the n-gram axis, limb by limb.
    high = lax.associative_scan(jnp.bitwise_xor, ph, axis=ph.ndim - 1)[..., 1:, None]
    low = lax.associative_scan(jnp.bitwise_xor, pl, axis=pl.ndim - 1)[..., 1:, None]
    primes = jnp.asarray(np.asarray(layout.sizes[slot], np.uint32))  # [Nmax-1, Ne]
    offsets = jnp.asarray(np.asarray(layout.offsets(slot), np.int32))
    return _mod_u64(high, low, primes).astype(jnp.int32) + offsets


# -------------------------------------------------------------------- 5. embedding, projection and gate


def engram_embed(codes: jax.Array, scales: jax.Array, rows: jax.Array) -> jax.Array:
    """Fetch and dequantise table rows: ``[..., Nmax-1, Ne]`` rows -> ``float32 [..., (Nmax-1)·Ne·De]`` (§9.4).

    ``codes [R, De]`` are E4M3 bytes, ``scales [R, De/32]`` UE8M0 bytes (§12.1.3). Only the fetched rows are
    decoded; the columns are concatenated order-major, head-minor, as ``engram.wkv`` expects.
    """
    if codes.ndim != 2 or scales.shape != (codes.shape[0], codes.shape[1] // _SCALE_GROUP):
        raise ValueError(
            f"engram table: codes {codes.shape} and scales {scales.shape} must be [R, De] and [R, De/32]"
        )
    values = e4m3_decode(jnp.take(codes, rows, axis=0))  # [..., O, Ne, De]
    scale = ue8m0_decode(jnp.take(scales, rows, axis=0))  # [..., O, Ne, De/32]
    values = values.reshape(*values.shape[:-1], -1, _SCALE_GROUP) * scale[..., None]
    return values.reshape(*rows.shape[:-2], -1)


def engram_embed_dense(table: jax.Array, rows: jax.Array) -> jax.Array:
    """:func:`engram_embed` for an unquantised table ``[R, De]`` (a float-weight model): the fetched rows in
    float32, concatenated order-major, head-minor."""
    if table.ndim != 2:
        raise ValueError(f"engram table: expected [R, De], got shape {table.shape}")
    values = jnp.take(table, rows, axis=0).astype(jnp.float32)  # [..., O, Ne, De]
    return values.reshape(*rows.shape[:-2], -1)


def engram_gate(
    streams: jax.Array,
    keys: jax.Array,
    value: jax.Array,
    q_weight: jax.Array,
    k_weight: jax.Array,
    *,
    eps: float,
) -> jax.Array:
    """``R'[s] = R[s] + γ_s · V`` with the per-stream gate of §9.4, computed in float32.

    Args:
        streams: ``R [..., m, H]``; keys: ``K [..., m, H]``; value: ``V [..., H]``.
        q_weight, k_weight: ``[m, H]`` (``engram.q_weight`` on the stream side, ``engram.k_weight`` on the key
            side).
        eps: ``rms_norm_eps``; each stream and each key is RMS-normalised over ``H`` alone.

    Returns ``R'`` in the dtype of ``streams``.
    """
    r = streams.astype(jnp.float32)
    k = keys.astype(jnp.float32)
    H = r.shape[-1]
    rx = lax.rsqrt(jnp.mean(r * r, axis=-1) + eps)
    rk = lax.rsqrt(jnp.mean(k * k, axis=-1) + eps)
    wq, wk = q_weight.astype(jnp.float32), k_weight.astype(jnp.float32)
    dot = jnp.sum(r * wq * k * wk, axis=-1) * rx * rk / np.sqrt(H)
    gate = jax.nn.sigmoid(jnp.sign(dot) * jnp.sqrt(jnp.maximum(jnp.abs(dot), _GATE_CLAMP)))
    out = r + gate[..., None] * value.astype(jnp.float32)[..., None, :]
    return out.astype(streams.dtype)


def engram_layer(
    params: dict[str, Any],
    streams: jax.Array,
    rows: jax.Array,
    *,
    eps: float,
    numerics: LinearNumerics,
) -> jax.Array:
    """One Engram application on the stream state ``R [..., m, H]`` given the layer's rows ``[..., Nmax-1, Ne]``.

    ``params``: ``embed`` (``{"weight": codes, "scale": scales}``, or ``{"weight": table}`` unquantised in a
    float-weight model), ``wkv`` (a linear weight dict, FP8 in a quantised checkpoint), ``q_weight`` and
    ``k_weight`` (``[m, H]``). The fetched rows of an FP8 table are already FP8 values, so the activation cast of
    the ``wkv`` GEMM leaves them unchanged.
    """
    m, H = streams.shape[-2:]
    table = params["embed"]
    if "scale" in table:
        emb = engram_embed(table["weight"], table["scale"], rows)
    else:
        emb = engram_embed_dense(table["weight"], rows)
    kv = linear(emb, params["wkv"], numerics, out_dtype=streams.dtype)
    if kv.shape[-1] != (m + 1) * H:
        raise ValueError(
            f"engram.wkv: {kv.shape[-1]} outputs; expected (hc_mult + 1) * hidden = {(m + 1) * H}"
        )
    kv = kv.reshape(*kv.shape[:-1], m + 1, H)
    return engram_gate(
        streams, kv[..., :m, :], kv[..., m, :], params["q_weight"], params["k_weight"], eps=eps
    )
