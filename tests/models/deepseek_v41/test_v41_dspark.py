"""The DSpark drafter of DeepSeek-V4.1 (spec/model.md §11) and the backbone's target-feature capture (§11.1).

The drafter of ``tiny-v41`` (two draft layers, 4 experts of which 2 per token, ``B = 4``, ``W = 16``) runs
against a float64 NumPy re-derivation written here from the spec (weight decoding and the mHC mixing shared with the
backbone's, in tests/v41_reference.py): it decodes the FP8 (32x32 UE8M0 blocks) and MXFP4 weights with
ml_dtypes and a lookup table and does the context keys, the block attention (window of
context keys plus every block key, sinks, grouped output projection), the mHC of both schedules, the MoE, the
collapse and the sequential Markov-corrected heads. The capture is checked on a two-layer cut (Engram, then a
window layer) against the same NumPy layer code.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from v41_reference import fp4, fp8, hc_mix, sigmoid  # tests/v41_reference.py

from deepinfer_jax.checkpoint.model_loading import load_model
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.models.builtin import TensorRngFactory, get_builtin, hf_config
from deepinfer_jax.models.deepseek_v4 import family_v41, v41_model
from deepinfer_jax.models.deepseek_v4.dspark import (
    CONFIDENCE_CLAMP,
    ContextKeys,
    DSparkStatic,
    context_keys,
    draft,
    draft_after_prefix,
    draft_hidden,
)
from deepinfer_jax.models.deepseek_v4.engram import engram_layer, hash_rows, ngram_ids
from deepinfer_jax.models.deepseek_v4.synthetic import generate_v41_weights

S = 24  # prefix length: longer than W = 16, so the window of the last position starts after position 0
P = np.array([23, 10], np.int32)  # row 0 clips its window (lo = 8), row 1 does not (lo = 0)

_draft = jax.jit(draft, static_argnames="static")
_hidden = jax.jit(draft_hidden, static_argnames="static")


# ------------------------------------------------------------------------------ float64 re-derivation


class Ref:
    """The spec's drafter and window layers in float64 NumPy, over raw checkpoint tensors ``t``."""

    def __init__(self, cfg, t, hc_head=None):
        self.cfg, self.t, self.hc_head = cfg, t, hc_head
        self._decoded: dict[tuple[str, str], np.ndarray] = {}
        self.eps, self.m = cfg.rms_norm_eps, cfg.hc_mult
        self.D, self.Dr, self.W = cfg.head_dim, cfg.qk_rope_head_dim, cfg.sliding_window
        self.Nh, self.G, self.Ro = cfg.num_attention_heads, cfg.o_groups, cfg.o_lora_rank
        # Main RoPE, no YaRN (§3.1, §3.2): θ_i = rope_theta^(-2i/Dr).
        self.freqs = cfg.rope.theta ** (-np.arange(0, self.Dr, 2, dtype=np.float64) / self.Dr)
        self.gaps: list[float] = []

    def fp8(self, name):
        if (name, "fp8") not in self._decoded:
            self._decoded[name, "fp8"] = fp8(self.t, name)
        return self._decoded[name, "fp8"]

    def fp4(self, name):
        if (name, "fp4") not in self._decoded:
            self._decoded[name, "fp4"] = fp4(self.t, name)
        return self._decoded[name, "fp4"]

    def f64(self, name):
        return np.asarray(self.t[name]).astype(np.float64)

    def rms(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def rope(self, x, pos, inverse=False):
        out, d = x.copy(), self.Dr
        ang = np.asarray(pos, np.float64)[:, None] * self.freqs
        c, s = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
        if x.ndim == 3:
            c, s = c[:, None], s[:, None]
        z0, z1 = x[..., -d::2], x[..., -d + 1 :: 2]
        out[..., -d::2] = z0 * c - z1 * s
        out[..., -d + 1 :: 2] = z0 * s + z1 * c
        return out

    def hc_mix(self, R, prefix):
        """pre, post, comb of one sub-layer for one token's streams R [m, H] (§6.3)."""
        return hc_mix(R, self.t, prefix, self.cfg)

    def keys(self, x, a, pos):
        """Window keys RoPE(RMSNorm(x·wkvᵀ; kv_norm)) of rows x [N, H'] at positions pos (§7.2)."""
        return self.rope(self.rms(x @ self.fp8(f"{a}wkv").T, self.f64(f"{a}kv_norm.weight")), pos)

    def attention(self, x, a, pos, extra_keys, visible):
        """§7.1, §7.5, §7.7 for x̂ [S, H] at pos: keys = extra_keys then the rows' own keys; visible [S, N+S]."""
        qn = self.rms(x @ self.fp8(f"{a}wq_a").T, self.f64(f"{a}q_norm.weight"))
        q = self.rope((qn @ self.fp8(f"{a}wq_b").T).reshape(len(x), self.Nh, self.D), pos)
        keys = np.concatenate([extra_keys, self.keys(x, a, pos)])
        sinks = self.f64(f"{a}attn_sink")
        out = np.zeros((len(x), self.Nh, self.D))
        for r in range(len(x)):
            k = keys[visible[r]]
            ex = np.exp(q[r] @ k.T / np.sqrt(self.D))
            out[r] = (ex @ k) / (ex.sum(-1) + np.exp(sinks))[:, None]
        out = self.rope(out, pos, inverse=True).reshape(len(x), self.G, -1)
        wo_a = self.fp8(f"{a}wo_a")
        z = np.concatenate(
            [out[:, g] @ wo_a[g * self.Ro : (g + 1) * self.Ro].T for g in range(self.G)], axis=-1
        )
        return z @ self.fp8(f"{a}wo_b").T

    def moe(self, x, f, k):
        """§8: sqrt-softplus router with selection bias, top-k, MXFP4 experts (weight before w2), shared expert."""
        lim, rsf = self.cfg.swiglu_limit, self.cfg.routed_scaling_factor

        def swiglu(g, u):
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
            return g * sigmoid(g) * u

        z = x @ self.f64(f"{f}gate.weight").T
        sigma = np.sqrt(np.where(z > 20, z, np.log1p(np.exp(np.minimum(z, 20)))))
        choice = sigma + self.f64(f"{f}gate.bias")
        out = np.zeros_like(x)
        for i in range(len(x)):
            order = np.argsort(-choice[i], kind="stable")
            self.gaps.append(choice[i, order[k - 1]] - choice[i, order[k]])
            top = order[:k]
            w = sigma[i, top] / (sigma[i, top].sum() + 1e-20) * rsf
            for e, we in zip(top, w, strict=True):
                ex = f"{f}experts.{e}."
                out[i] += self.fp4(f"{ex}w2") @ (
                    swiglu(self.fp4(f"{ex}w1") @ x[i], self.fp4(f"{ex}w3") @ x[i]) * we
                )
        sh = f"{f}shared_experts."
        return out + swiglu(x @ self.fp8(f"{sh}w1").T, x @ self.fp8(f"{sh}w3").T) @ self.fp8(f"{sh}w2").T

    def block(self, R, carried, prefix, pos, extra_keys, visible, k, shifted):
        """One HC block (§6.4) over R [S, m, H]: attention then MoE; returns (R', carried pre-mix)."""
        for sub in ("attn", "ffn"):
            mixes = [self.hc_mix(R[i], f"{prefix}hc_{sub}") for i in range(len(R))]
            pre = np.stack([mx[0] for mx in mixes])
            read = carried if shifted else pre
            x = self.rms(np.einsum("sm,smh->sh", read, R), self.f64(f"{prefix}{sub}_norm.weight"))
            if sub == "attn":
                y = self.attention(x, f"{prefix}attn.", pos, extra_keys, visible)
            else:
                y = self.moe(x, f"{prefix}ffn.", k)
            R = np.stack([mx[1][:, None] * y[i] + mx[2].T @ R[i] for i, mx in enumerate(mixes)])
            carried = pre
        return R, carried

    # --------------------------------------------------------------------------------------- §11

    def context_keys(self, phi):
        """κ_i [N, D] per draft layer from Φ [N, T·H] at positions 0 .. N-1 (§11.1)."""
        c = self.rms(phi @ self.fp8("mtp.0.main_proj").T, self.f64("mtp.0.main_norm.weight"))
        n = self.cfg.num_nextn_predict_layers
        return [self.keys(c, f"mtp.{i}.attn.", np.arange(len(phi))) for i in range(n)]

    def draft(self, kappa, g, p, B, *, shifted=True, temperature=1.0):
        """Tokens, log-probabilities and confidences of one draft step after position p (§11.2)."""
        cfg, m = self.cfg, self.m
        block = [g] + [cfg.dspark_noise_token_id] * (B - 1)
        pos = p + 1 + np.arange(B)
        lo = max(0, p - self.W + 1)
        R = np.repeat(self.f64("embed.weight")[block][:, None, :], m, axis=1)
        carried = np.tile(np.eye(m)[0], (B, 1))
        visible = np.ones((B, p + 1 - lo + B), bool)  # every row: the context window and the whole block
        for i in range(cfg.num_nextn_predict_layers):
            R, carried = self.block(
                R,
                carried,
                f"mtp.{i}.",
                pos,
                kappa[i][lo : p + 1],
                visible,
                cfg.dspark_num_experts_per_tok,
                shifted,
            )
        if shifted:
            h = np.einsum("sm,smh->sh", carried, R)
        else:
            fn, base, scale = (np.asarray(self.hc_head[k], np.float64) for k in ("fn", "base", "scale"))
            flat = R.reshape(B, -1)
            mu = flat @ fn.T / np.sqrt(np.mean(flat * flat, axis=1, keepdims=True) + self.eps)
            h = np.einsum("sm,smh->sh", sigmoid(mu * scale[0] + base) + cfg.hc_eps, R)
        last = f"mtp.{cfg.num_nextn_predict_layers - 1}."
        base_logits = self.rms(h, self.f64(f"{last}norm.weight")) @ self.f64("head.weight").T
        membed, mhead = (
            self.f64(f"{last}markov_head.embed.weight"),
            self.f64(f"{last}markov_head.head.weight"),
        )
        conf_w = self.f64(f"{last}confidence_head.proj.weight")[0]
        prev, tokens, logps, confs, margins = g, [], [], [], []
        for i in range(B):
            logits = base_logits[i] + mhead @ membed[prev]
            raw = np.concatenate([h[i], membed[prev]]) @ conf_w / temperature
            top2 = np.sort(logits)[-2:]
            margins.append(top2[1] - top2[0])
            d = int(np.argmax(logits))
            logps.append(logits[d] - logits.max() - np.log(np.sum(np.exp(logits - logits.max()))))
            confs.append(sigmoid(np.clip(raw, -60, 60)))
            tokens.append(d)
            prev = d
        return np.array(tokens), np.array(logps), np.array(confs), min(margins)


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-v41")


@pytest.fixture(scope="module")
def static(tiny):
    return DSparkStatic.from_config(tiny.config)


@pytest.fixture(scope="module")
def tensors(tiny):
    t = generate_v41_weights(hf_config("tiny-v41"), TensorRngFactory(get_builtin("tiny-v41").seed))
    # The raw tensors are the ones load_model assembled (same generator, same seed).
    np.testing.assert_array_equal(np.asarray(tiny.params["embed"]), np.asarray(t["embed.weight"], np.float32))
    np.testing.assert_array_equal(
        np.asarray(tiny.params["mtp"][0]["main_proj"]["weight"]),
        np.asarray(t["mtp.0.main_proj.weight"]).view(np.uint8),
    )
    return t


@pytest.fixture(scope="module")
def run(tiny, static):
    """One jitted backbone + drafter run over a batch whose rows have real lengths ``P + 1`` (row 1 padded)."""
    ids = np.random.default_rng(11).integers(0, 512, (2, S)).astype(np.int32)
    return ids, jax.jit(draft_after_prefix, static_argnames="static")(
        tiny.params, ids, static=static, lengths=P + 1
    )


@pytest.fixture(scope="module")
def prefix(run):
    ids, out = run
    return ids, np.asarray(out.logits), np.asarray(out.features), out.context, np.asarray(out.golden)


@pytest.fixture(scope="module")
def drafted(run):
    return run[1].drafts


# ------------------------------------------------------------------------------------- (a) numerics


def test_static_of_tiny_v41(tiny, static):
    assert (static.target_layer_ids, static.num_layers, static.block_size) == ((4, 5, 6), 2, 4)
    assert (static.num_experts, static.top_k, static.markov_rank, static.noise_token_id) == (4, 2, 32, 511)
    assert static.attention.window == 16 and not static.round_features
    assert static.attention.casts.draft_keys == "none"
    prod = DSparkStatic.from_config(tiny.config, dtype="bfloat16", block_size=5)
    assert prod.backbone.dtype == "bfloat16"
    assert prod.round_features and prod.attention.casts.draft_keys == "mxfp8" and prod.block_size == 5


def test_context_keys_match_the_rederivation(tiny, tensors, prefix):
    _, _, phi, ctx, _ = prefix
    ref = Ref(tiny.config, tensors)
    assert ctx.positions.shape == (2, S) and len(ctx.keys) == 2
    np.testing.assert_array_equal(np.asarray(ctx.positions), np.tile(np.arange(S), (2, 1)))
    for b in range(2):
        for i, want in enumerate(ref.context_keys(phi[b].astype(np.float64))):
            # Two FP8 GEMMs (K = 768, 256) and two RMSNorms of O(1) float32 values: measured ~1e-6; unit-scale
            # keys after kv_norm, so 2e-5 is a structural check (a wrong rope pair or scale block moves O(0.1)).
            np.testing.assert_allclose(np.asarray(ctx.keys[i][b]), want, atol=2e-5, rtol=0)


def test_draft_matches_the_rederivation(tiny, tensors, static, prefix, drafted):
    _, _, phi, _, golden = prefix
    ref = Ref(tiny.config, tensors)
    for b in range(2):
        kappa = ref.context_keys(phi[b].astype(np.float64))
        tokens, logps, confs, margin = ref.draft(kappa, int(golden[b]), int(P[b]), static.block_size)
        # float32 noise (~1e-5 on logits) cannot flip an argmax or a router choice across these gaps, so the
        # comparison below is of identical discrete choices.
        assert margin > 1e-3 and min(ref.gaps) > 1e-3
        np.testing.assert_array_equal(np.asarray(drafted.tokens[b]), tokens)
        # Two draft layers of float32 GEMMs (K <= 768) against float64, log-probs of magnitude ~3 and logits ~4:
        # measured < 1e-5; 1e-4 leaves room for other BLAS builds while any structural slip (mask, schedule,
        # Markov row, clamp) moves them by O(0.01) or more.
        np.testing.assert_allclose(np.asarray(drafted.logprobs[b]), logps, atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(drafted.confidences[b]), confs, atol=1e-5, rtol=0)


def test_non_shifted_schedule_matches_the_rederivation(tiny, tensors, static, prefix):
    """Non-shifted: every sub-layer reads with its own pre-mix and ``mtp.{M-1}.hc_head_*`` collapses (§6.5)."""
    _, _, phi, ctx, golden = prefix
    m, H = static.backbone.hc_mult, static.backbone.hidden
    rng = np.random.default_rng(2)
    hc_head = {
        "fn": (rng.standard_normal((m, m * H)) * 0.05).astype(np.float32),
        "base": rng.standard_normal(m).astype(np.float32),
        "scale": np.array([0.5], np.float32),
    }
    params = dict(tiny.params)
    params["mtp"] = [*tiny.params["mtp"][:-1], {**tiny.params["mtp"][-1], "hc_head": hc_head}]
    ns = dataclasses.replace(static, backbone=dataclasses.replace(static.backbone, hc_shifted=False))
    got = _draft(params, ctx, golden, P, static=ns)
    ref = Ref(tiny.config, tensors, hc_head=hc_head)
    for b in range(2):
        tokens, logps, confs, margin = ref.draft(
            ref.context_keys(phi[b].astype(np.float64)),
            int(golden[b]),
            int(P[b]),
            static.block_size,
            shifted=False,
        )
        assert margin > 1e-3 and min(ref.gaps) > 1e-3
        np.testing.assert_array_equal(np.asarray(got.tokens[b]), tokens)
        # Same budget as the shifted comparison.
        np.testing.assert_allclose(np.asarray(got.logprobs[b]), logps, atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.asarray(got.confidences[b]), confs, atol=1e-5, rtol=0)


def test_draft_after_prefix_is_backbone_then_draft(tiny, static, run, drafted):
    """The convenience path: backbone logits and Φ, g = argmax at each row's last real position, then draft."""
    out = run[1]
    np.testing.assert_array_equal(np.asarray(out.p), P)
    np.testing.assert_array_equal(
        np.asarray(out.golden), np.argmax(np.asarray(out.logits)[[0, 1], P], axis=-1)
    )
    assert out.features.shape == (2, S, 3 * 256) and out.features.dtype == jnp.float32
    alone = _draft(tiny.params, out.context, out.golden, out.p, static=static)
    np.testing.assert_array_equal(np.asarray(alone.tokens), np.asarray(drafted.tokens))
    # Two compilations of the same float32 graph: fusion may reassociate sums, nothing more.
    np.testing.assert_allclose(np.asarray(alone.logprobs), np.asarray(drafted.logprobs), atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        np.asarray(alone.confidences), np.asarray(drafted.confidences), atol=1e-6, rtol=0
    )


# ---------------------------------------------------------------------- (b) bidirectionality, window


def test_block_rows_see_each_other(tiny, static, prefix):
    _, _, _, ctx, golden = prefix
    block = np.concatenate([golden[:, None], np.full((2, 3), static.noise_token_id, np.int32)], axis=1)
    base = np.asarray(_hidden(tiny.params, ctx, block, P, static=static))
    changed = block.copy()
    changed[:, 3] = 7  # the last block position only
    out = np.asarray(_hidden(tiny.params, ctx, changed, P, static=static))
    # Row 0 precedes row 3 and still moves: the block keys are visible both ways (a causal block would leave
    # rows 0..2 bitwise unchanged). The change is far above float32 noise (~1e-6).
    assert np.abs(out[:, :3] - base[:, :3]).max(axis=(1, 2)).min() > 1e-3


def test_context_keys_outside_the_window_do_not_matter(tiny, static, prefix, drafted):
    _, _, _, ctx, golden = prefix
    pos = np.arange(S)
    W = static.attention.window
    outside = np.stack([(pos < p - W + 1) | (pos > p) for p in P])  # row 0: 0..7; row 1: 11..23
    assert outside[0, :8].all() and outside[1, 11:].all() and not outside[1, :11].any()
    noise = np.random.default_rng(4).standard_normal(ctx.keys[0].shape).astype(np.float32) * 10
    far = ContextKeys(tuple(k + noise * outside[:, :, None] for k in ctx.keys), ctx.positions)
    got = _draft(tiny.params, far, golden, P, static=static)
    # Masked keys contribute exact zeros: bitwise equal.
    for a, b in zip(got, drafted, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    near = ContextKeys(tuple(k + noise * ~outside[:, :, None] for k in ctx.keys), ctx.positions)
    moved = _draft(tiny.params, near, golden, P, static=static)
    assert (np.abs(np.asarray(moved.logprobs) - np.asarray(drafted.logprobs)).max(axis=1) > 1e-3).all()


def test_ring_slots_are_read_by_position(tiny, static, prefix, drafted):
    """Keys are matched by their position, not their slot: a permuted buffer with empty slots gives the same."""
    _, _, _, ctx, golden = prefix
    perm = np.random.default_rng(5).permutation(S)
    positions = np.asarray(ctx.positions)[:, perm].copy()
    keys = [np.asarray(k)[:, perm] for k in ctx.keys]
    positions[positions < 3] = -1  # empty slots; their keys lie outside the window anyway (lo = 8)
    ring = ContextKeys(tuple(jnp.asarray(k) for k in keys), jnp.asarray(positions))
    p = np.array([23, 23], np.int32)
    got = _draft(tiny.params, ring, golden, p, static=static)
    want = _draft(tiny.params, ctx, golden, p, static=static)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # A permutation of the key axis reorders the softmax sums: float32 reassociation only.
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- (c) per-row positions


def test_batch_rows_equal_each_sequence_alone(tiny, static, prefix, drafted):
    _, _, _, ctx, golden = prefix
    for b in range(2):
        n = int(P[b]) + 1  # alone: only the keys the sequence has
        alone_ctx = ContextKeys(tuple(k[b : b + 1, :n] for k in ctx.keys), ctx.positions[b : b + 1, :n])
        alone = _draft(tiny.params, alone_ctx, golden[b : b + 1], P[b : b + 1], static=static)
        np.testing.assert_array_equal(np.asarray(alone.tokens[0]), np.asarray(drafted.tokens[b]))
        # Different batch and key-axis sizes change XLA's reduction shapes: float32 reassociation only.
        np.testing.assert_allclose(np.asarray(alone.logprobs[0]), np.asarray(drafted.logprobs[b]), atol=1e-5)
        np.testing.assert_allclose(
            np.asarray(alone.confidences[0]), np.asarray(drafted.confidences[b]), atol=1e-6
        )


# ------------------------------------------------------------------------------------ (d) properties


@settings(max_examples=5, deadline=None)
@given(
    golden=st.lists(st.integers(0, 511), min_size=2, max_size=2),
    p=st.lists(st.integers(0, S - 1), min_size=2, max_size=2),
)
def test_outputs_are_well_formed(tiny, static, prefix, golden, p):
    ctx = prefix[3]
    out = _draft(tiny.params, ctx, np.array(golden, np.int32), np.array(p, np.int32), static=static)
    tokens, logps, confs = (np.asarray(a) for a in out)
    assert tokens.shape == logps.shape == confs.shape == (2, static.block_size)
    assert tokens.dtype == np.int32 and ((tokens >= 0) & (tokens < 512)).all()
    # The argmax token's log-probability is at least that of a uniform distribution and at most 0.
    assert ((logps <= 0) & (logps >= -np.log(512) - 1e-5)).all()
    assert ((confs > 0) & (confs < 1)).all()


def test_confidence_logit_is_clamped(tiny, static, prefix, drafted):
    """A saturated confidence logit gives sigmoid(±60), not 0: the clamp of §11.2 (the spec is the contract)."""
    _, _, _, ctx, golden = prefix
    last = tiny.params["mtp"][-1]
    params = dict(tiny.params)
    params["mtp"] = [*tiny.params["mtp"][:-1], {**last, "confidence": last["confidence"] * 1e6}]
    confs = np.asarray(_draft(params, ctx, golden, P, static=static).confidences)
    raw_sign = np.asarray(drafted.confidences) > 0.5  # the sign of each raw logit, unchanged by the scaling
    low = np.float32(1 / (1 + np.exp(CONFIDENCE_CLAMP)))  # ~8.8e-27, a normal float32
    assert raw_sign.any() and not raw_sign.all()
    # |raw| ~ 1e6 would give exactly 0 below; the clamp leaves sigmoid(-60). sigmoid(60) rounds to 1 in float32.
    np.testing.assert_allclose(confs[~raw_sign], low, rtol=1e-5)
    assert (confs[raw_sign] == np.float32(1.0)).all()


# ------------------------------------------------------------------------------------- capture (§11.1)


def two_layer_config() -> ModelConfig:
    """Layer 0: window + Engram; layer 1: window. No draft layers, identity Engram compression (no tokenizer)."""
    hf = copy.deepcopy(hf_config("tiny-v41"))
    hf["text_config"].update(
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
        compress_ratios=[0, 0],
        kv_source_layer_ids=[],
        index_source_layer_ids=[],
        index_k_source_layer_ids=[],
        candidate_source_layer_id=None,
        candidate_topk_blocks=None,
        candidate_block_size=None,
        dspark_target_layer_ids=None,
        engram_layer_ids=[0],
        engram_num_embeddings=[4062],
        engram_compressed_vocab_size=512,
    )
    return ModelConfig.from_hf(hf)


def test_capture_is_the_stream_mean_entering_attention_after_engram():
    cfg = two_layer_config()
    seed = 9
    t = generate_v41_weights(cfg.hf, TensorRngFactory(seed))
    params = family_v41.init_params(cfg, seed)
    bb = family_v41.static_for(cfg)
    ids = np.random.default_rng(6).integers(0, 512, (2, 20)).astype(np.int32)
    fwd = jax.jit(v41_model.forward_with_features, static_argnames=("static", "capture_layers"))
    _, feats = fwd(params, ids, static=bb, capture_layers=(1, 0))
    assert sorted(feats) == [0, 1] and feats[0].shape == (2, 20, cfg.hidden_size)
    # Layer 0 is captured after Engram: the streams that Engram (the model's own, tested elsewhere) leaves.
    e = np.asarray(params["embed"])[ids]

    @jax.jit
    def after_engram(engram, e, ids):
        layout = bb.engram
        grams, _ = ngram_ids(ids, None, max_ngram_size=layout.max_ngram_size, pad_id=layout.pad_id)
        streams = jnp.broadcast_to(e[:, :, None], (*e.shape[:2], cfg.hc_mult, e.shape[-1]))
        return engram_layer(engram, streams, hash_rows(grams, layout, 0), eps=bb.eps, numerics=bb.numerics)

    R0 = np.asarray(after_engram(params["layers"][0]["engram"], e, ids))
    # float32 on both sides, the same mean: only the order of the 4-term sum may differ.
    np.testing.assert_allclose(np.asarray(feats[0]), R0.mean(axis=2), atol=1e-6, rtol=0)
    assert np.abs(np.asarray(feats[0]) - e).max() > 1e-2  # Engram did change the streams
    # Layer 1's feature: layer 0's attention and MoE in float64 on top of those streams.
    ref = Ref(cfg, t)
    pos = np.arange(20)
    window = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - cfg.sliding_window)
    for b in range(2):
        R, _ = ref.block(
            R0[b].astype(np.float64),
            np.tile(np.eye(cfg.hc_mult)[0], (20, 1)),
            "layers.0.",
            pos,
            np.zeros((0, cfg.head_dim)),
            window,
            cfg.num_experts_per_tok,
            True,
        )
        # One layer of float32 GEMMs against float64 on O(1) streams: measured ~1e-6.
        np.testing.assert_allclose(np.asarray(feats[1][b]), R.mean(axis=1), atol=2e-5, rtol=0)
    assert min(ref.gaps) > 1e-3  # identical router choices on both sides


# ---------------------------------------------------------------------------------------- (e) errors


def test_config_errors(tiny, static):
    cfg = tiny.config
    with pytest.raises(TypeError, match="DeepseekV41Config"):
        DSparkStatic.from_config(hf_config("tiny-v41"))
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers = 0: the model has no DSpark"):
        DSparkStatic.from_config(two_layer_config())
    hf = copy.deepcopy(hf_config("tiny-v41"))
    hf["text_config"]["dspark_target_layer_ids"] = None
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids = None: the drafter needs"):
        DSparkStatic.from_config(ModelConfig.from_hf(hf), static.backbone)
    with pytest.raises(ValueError, match=r"block_size: 0 drafts per step; must be >= 1"):
        DSparkStatic.from_config(cfg, static.backbone, block_size=0)
    with pytest.raises(TypeError, match=r"block_size: expected an int, got str '4'"):
        DSparkStatic.from_config(cfg, static.backbone, block_size="4")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="confidence_temperature"):
            DSparkStatic.from_config(cfg, static.backbone, confidence_temperature=bad)
    with pytest.raises(ValueError, match=r"dtype: 'float16' is not a precision mode"):
        DSparkStatic.from_config(cfg, static.backbone, dtype="float16")
    with pytest.raises(
        ValueError, match=r"dtype: 'bfloat16', but the backbone statics are in mode 'float32'"
    ):
        DSparkStatic.from_config(cfg, static.backbone, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"backbone: statics of 2 layers, text_config.num_hidden_layers = 7"):
        DSparkStatic.from_config(cfg, family_v41.static_for(two_layer_config()))


def test_input_errors(tiny, static, prefix):
    _, _, phi, ctx, golden = prefix
    params = tiny.params
    with pytest.raises(ValueError, match=r"capture_layers\[1\]: 7 is not a backbone layer index in \[0, 7\)"):
        v41_model.forward_with_features(
            params, np.zeros((1, 4), np.int32), static=static.backbone, capture_layers=(0, 7)
        )
    with pytest.raises(ValueError, match=r"params\['mtp'\]: 1 draft layers, .*num_nextn_predict_layers = 2"):
        context_keys({**params, "mtp": params["mtp"][:1]}, jnp.asarray(phi), static=static)
    with pytest.raises(ValueError, match=r"features: expected \[sequences, tokens, 768\]"):
        context_keys(params, jnp.asarray(phi[..., :256]), static=static)
    with pytest.raises(ValueError, match=r"context.keys: 1 arrays, one per draft layer expected \(2\)"):
        draft(params, ContextKeys(ctx.keys[:1], ctx.positions), golden, P, static=static)
    with pytest.raises(ValueError, match=r"p: 1 rows, expected 2"):
        draft(params, ctx, golden, P[:1], static=static)
    with pytest.raises(ValueError, match=r"golden: expected an integer array \[sequences\]"):
        draft(params, ctx, golden.astype(np.float32), P, static=static)
    with pytest.raises(ValueError, match=r"lengths: \[0, 24\]; each must lie in \[1, 24\]"):
        draft_after_prefix(params, prefix[0], static=static, lengths=np.array([0, 24]))
    bad = dataclasses.replace(static, num_experts=8)
    with pytest.raises(ValueError, match=r"params\['mtp'\]\[0\]\['ffn'\]: 4 routed experts, .*= 8"):
        draft(params, ctx, golden, P, static=bad)
