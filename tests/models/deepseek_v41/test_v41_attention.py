"""V4.1 attention over a prefix with cross-layer sharing, YOCO and candidate blocks (spec §7.1-§7.11).

The seven layers of the tiny config (§15.1) run in order on independent random inputs, and every layer's output is
compared with a float64 NumPy re-derivation of §7.11 written here: its own compressor, indexer, candidate blocks,
sink softmax, de-rotation and grouped projection, with the sharing decided from the raw config lists.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config import load_model_config
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.deepseek_v4.plan_v41 import build_v41_plan
from deepinfer_jax.models.deepseek_v4.v41_attention import CrossLayer, V41AttentionSpec, attention_prefix
from deepinfer_jax.ops import RopeParams

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
B, S = 1, 96  # 96 tokens: ratio-1 layers see 96 keys > Bc·bs = 64, so candidate blocks restrict the choice


@pytest.fixture(scope="module")
def cfg():
    return load_model_config(CONFIGS / "tiny_v41.yaml")


def make_params(cfg, rng):
    H, D, Rq, Nh, G, Ro = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.q_lora_rank,
        cfg.num_attention_heads,
        cfg.o_groups,
        cfg.o_lora_rank,
    )
    Hi, Di = cfg.index_n_heads, cfg.index_head_dim

    def w(out, inp):
        return rng.normal(size=(out, inp)) / np.sqrt(inp)

    layers = []
    for ratio in cfg.compress_ratios:
        p = {
            "wq_a": w(Rq, H),
            "q_norm": 1 + 0.1 * rng.normal(size=Rq),
            "wq_b": w(Nh * D, Rq),
            "wkv": w(D, H),
            "kv_norm": 1 + 0.1 * rng.normal(size=D),
            "wo_a": w(G * Ro, Nh // G * D),
            "wo_b": w(H, G * Ro),
            "sinks": rng.normal(size=Nh),
        }
        if ratio:
            p["compressor"] = {"wkv": w(D, H), "norm": 1 + 0.1 * rng.normal(size=D)}
            if ratio == 2:
                p["compressor"]["wgate"] = w(D, H)
            p["indexer"] = {
                "wq_b": w(Hi * Di, Rq),
                "weights_proj": w(Hi, H),
                "wk": w(Di, D),
                "k_norm": 1 + 0.1 * rng.normal(size=Di),
            }
        layers.append(p)
    return layers


def to_device(p):
    linear = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")
    out = {
        k: ({"weight": jnp.asarray(v, jnp.float32)} if k in linear else jnp.asarray(v, jnp.float32))
        for k, v in p.items()
        if not isinstance(v, dict)
    }
    if "compressor" in p:
        out["compressor"] = {k: jnp.asarray(v, jnp.float32) for k, v in p["compressor"].items()}
        ip = p["indexer"]
        out["indexer"] = {
            "wq_b": {"weight": jnp.asarray(ip["wq_b"], jnp.float32)},
            **{k: jnp.asarray(ip[k], jnp.float32) for k in ("weights_proj", "wk", "k_norm")},
        }
    return out


# ------------------------------------------------------------------------------ float64 re-derivation


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, freqs, d, inverse=False, heads=False):
    """Interleaved pairs on the last d dims; ``pos [S]`` indexes axis 1 of ``x [B, S, (heads,) D]``."""
    out = x.copy()
    ang = np.asarray(pos, np.float64)[..., None] * freqs
    c, s = np.cos(ang), np.sin(ang) * (-1 if inverse else 1)
    if heads:
        c, s = c[:, None, :], s[:, None, :]
    z0, z1 = x[..., -d::2], x[..., -d + 1 :: 2]
    out[..., -d::2] = z0 * c - z1 * s
    out[..., -d + 1 :: 2] = z0 * s + z1 * c
    return out


def reference_layers(cfg, params, xs):
    """§7.11 for the whole prefix, layer by layer, with sharing from the raw lists."""
    L, W, D, Dr, eps = (
        cfg.num_hidden_layers,
        cfg.sliding_window,
        cfg.head_dim,
        cfg.qk_rope_head_dim,
        cfg.rms_norm_eps,
    )
    Nh, Hi, Di, G, Ro = (
        cfg.num_attention_heads,
        cfg.index_n_heads,
        cfg.index_head_dim,
        cfg.o_groups,
        cfg.o_lora_rank,
    )
    ktop, bc, bs, cs = (
        cfg.index_topk,
        cfg.candidate_topk_blocks,
        cfg.candidate_block_size,
        cfg.candidate_source_layer_id,
    )
    npl = cfg.compress_ratios.index(1)
    kv_src, ik_src, idx_src = (
        set(cfg.kv_source_layer_ids),
        set(cfg.index_k_source_layer_ids),
        set(cfg.index_source_layer_ids),
    )
    pos = np.arange(S)
    shared = P = K = KI = sel = cand = None
    ys = []
    for layer in range(L):
        p, x, r = params[layer], xs[layer], cfg.compress_ratios[layer]
        freqs = np.asarray(RopeParams.from_config(cfg.layer_rope(layer)).frequencies(Dr), np.float64)
        if layer == npl:
            shared = x
        qn = rms(x @ p["wq_a"].T, p["q_norm"], eps)
        q = rope((qn @ p["wq_b"].T).reshape(B, S, Nh, D), pos, freqs, Dr, heads=True)
        win = rope(rms(x @ p["wkv"].T, p["kv_norm"], eps), pos, freqs, Dr)
        allowed_c = None
        if r:
            if layer in kv_src:
                u = shared if layer > npl else x
                n = S // r
                a = (u @ p["compressor"]["wkv"].T)[:, : n * r].reshape(B, n, r, D)
                if r == 2:
                    g = (u @ p["compressor"]["wgate"].T)[:, : n * r].reshape(B, n, r, D)
                    e = np.exp(g - g.max(axis=2, keepdims=True))
                    c = (e * a).sum(2) / e.sum(2)
                else:
                    c = a[:, :, 0]
                P = rms(c, p["compressor"]["norm"], eps)
                K = rope(P, np.arange(n) * r, freqs, Dr)
            if layer in ik_src:
                ip = p["indexer"]
                KI = rope(rms(P @ ip["wk"].T, ip["k_norm"], eps), np.arange(P.shape[1]) * r, freqs, Dr)
            if layer in idx_src:
                ip = p["indexer"]
                qi = rope((qn @ ip["wq_b"].T).reshape(B, S, Hi, Di), pos, freqs, Dr, heads=True)
                wI = x @ ip["weights_proj"].T
                scores = np.einsum("bsh,bsht->bst", wI, np.maximum(np.einsum("bshd,btd->bsht", qi, KI), 0))
                sel = np.zeros((B, S, K.shape[1]), bool)
                new_cand = np.zeros((B, S, -(-K.shape[1] // bs)), bool)
                for b in range(B):
                    for t in range(S):
                        vis = list(range((t + 1) // r))
                        if cs is not None and layer > cs:
                            vis = [j for j in vis if cand[b, t, j // bs]]
                        order = sorted(vis, key=lambda j: -scores[b, t, j])
                        sel[b, t, order[:ktop]] = True
                        if layer == cs:
                            nvis = (t + 1) // r
                            nb = -(-nvis // bs)
                            blk = [
                                max(scores[b, t, j] for j in range(k * bs, min((k + 1) * bs, nvis)))
                                for k in range(nb)
                            ]
                            if nb:
                                blk[nb - 1] = np.inf
                            new_cand[b, t, np.argsort(blk)[::-1][:bc]] = True
                if layer == cs:
                    cand = new_cand
            allowed_c = sel
        out = np.zeros((B, S, Nh, D))
        for b in range(B):
            for t in range(S):
                keys = [win[b, u] for u in range(max(0, t - W + 1), t + 1)]
                if allowed_c is not None:
                    keys += [K[b, j] for j in np.flatnonzero(allowed_c[b, t])]
                keys = np.stack(keys)
                logits = (q[b, t] @ keys.T) / np.sqrt(D)  # [Nh, T]
                e = np.exp(logits)
                out[b, t] = (e @ keys) / (e.sum(-1) + np.exp(p["sinks"]))[:, None]
        out = rope(out, pos, freqs, Dr, inverse=True, heads=True)
        grouped = out.reshape(B, S, G, Nh // G * D)
        z = np.concatenate([grouped[:, :, g] @ p["wo_a"][g * Ro : (g + 1) * Ro].T for g in range(G)], axis=-1)
        ys.append(z @ p["wo_b"].T)
    return ys


def test_seven_layers_match_the_rederivation(cfg):
    rng = np.random.default_rng(11)
    params = make_params(cfg, rng)
    xs = [rng.normal(size=(B, S, cfg.hidden_size)) for _ in range(cfg.num_hidden_layers)]
    plan = build_v41_plan(cfg)
    specs = tuple(V41AttentionSpec.from_config(cfg, layer) for layer in range(cfg.num_hidden_layers))
    numerics = LinearNumerics()

    @jax.jit
    def run(device_params, inputs):
        cross, ys = CrossLayer(), []
        for lp, spec, p, x in zip(plan.layers, specs, device_params, inputs, strict=True):
            y, cross = attention_prefix(p, x, lp, spec, cross, numerics)
            ys.append(y)
        return ys, cross

    got, cross = run([to_device(p) for p in params], [jnp.asarray(x, jnp.float32) for x in xs])
    want = reference_layers(cfg, params, xs)
    assert cross.candidates is not None and cross.candidates.shape == (B, S, 96 // 8)
    # At position 95 the candidate consumers could choose among 96 keys, but only 8 blocks x 8 are kept.
    assert int(np.asarray(cross.candidates[0, -1]).sum()) == 8
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        # float32 against float64 through ~6 chained projections of O(1) values: 2e-4 absolute. A different
        # top-k or candidate choice would move outputs by O(0.1).
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-4, err_msg=f"layer {layer}")


def test_consumer_without_its_source_is_refused(cfg):
    plan = build_v41_plan(cfg)
    rng = np.random.default_rng(0)
    p = to_device(make_params(cfg, rng)[2])
    with pytest.raises(ValueError, match="layer 2 reads the compressed keys of layer 1"):
        attention_prefix(
            p,
            jnp.zeros((1, 4, cfg.hidden_size)),
            plan.layers[2],
            V41AttentionSpec.from_config(cfg, 2),
            CrossLayer(),
            LinearNumerics(),
        )
