"""Parity fixtures for DeepSeek-V3 from transformers' ``DeepseekV3ForCausalLM`` (the independent oracle).

Two tiny random V3 models are built here, from NumPy random weights written as an HF checkpoint under the
usual (per-expert) names, then loaded by transformers 5.24.0 (float32, eager attention) -- which also proves
that the names are the ones transformers maps:

* ``lora``: ``q_lora_rank`` set, one dense layer then two DeepSeekMoE layers (8 experts in 4 groups, top-2
  groups, top-2 experts, one shared expert, ``norm_topk_prob``), YaRN with ``mscale != mscale_all_dim`` (so both
  the cos/sin magnitude and the softmax-scale correction matter), spelled as real checkpoints spell it
  (top-level ``rope_theta`` + ``rope_scaling``), one MTP layer;
* ``nolora``: ``q_lora_rank: null`` (plain ``q_proj``), 8 experts in 2 groups (top-1 group, top-3 experts), two
  shared experts, ``norm_topk_prob: false``, YaRN spelled as transformers 5 writes it (``rope_parameters``).

Every norm weight and every router correction bias is randomised (nothing is an identity). Weights are rounded
to bfloat16 and stored as bfloat16 (as real checkpoints are); both sides compute in float32 from those values.

Per model, ``tests/data/v3/<name>/`` receives ``config.json``, ``model.safetensors`` and ``reference.npz``:

* ``input_ids [B, S]``: the prompts; ``logits [B, S, V]``: full forward of the prompts (no cache);
* ``generated [B, N]``: greedy ``generate`` continuations; ``decode_logits [B, N, V]``: the logits ``generate``
  produced step by step with its cache;
* ``sequence [B, S + N]`` and ``sequence_logits``: full forward (no cache) of prompt + continuation;
* ``mtp_logits [B, S + N - 1, V]``: the MTP layer run as transformers modules over the whole sequence
  (``eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])`` -> decoder layer -> ``shared_head``), with ``h_i`` the
  main model's post-final-norm hidden state.

Checks made while generating (a seed that fails one is skipped, so a fixture can never sit on a tie):

* routing margins: for every token of every MoE layer (MTP included), the gap between the last kept and the
  first dropped group score, and between the ``k``-th and ``(k+1)``-th eligible expert score, exceeds
  ``MIN_ROUTING_GAP`` (float32 disagreements are ~1e-6);
* greedy margins: at every generated step the top logit leads the runner-up by ``MIN_GREEDY_MARGIN``.

Environment (torch 2.13.0 CPU exists only for Python 3.11 here; it is a fixture tool, never a dependency)::

    python3.11 -m venv .venv-oracle && \\
        .venv-oracle/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    .venv-oracle/bin/python scripts/make_reference_fixtures.py --family v3 --out tests/data/v3
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
BATCH = 2
PROMPT_LEN = 12
NEW_TOKENS = 8
MIN_ROUTING_GAP = 1e-4
MIN_GREEDY_MARGIN = 1e-2
NORM_NOISE = 0.2
BIAS_STD = 0.05

_COMMON: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "use_cache": True,
    "rope_interleave": True,
}

MODELS: dict[str, dict[str, Any]] = {
    "lora": {
        **_COMMON,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": 24,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.7,
        },
    },
    "nolora": {
        **_COMMON,
        "num_hidden_layers": 2,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "num_experts_per_tok": 3,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.5,
        "max_position_embeddings": 128,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 5000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 0.8,
            "mscale_all_dim": 1.0,
        },
    },
}


# ------------------------------------------------------------------------------------------------- weights


def _bf16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(torch.bfloat16)


def make_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random bfloat16 tensors under the HF checkpoint names (per-expert projections, MTP as the next layer)."""
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    heads, nope, rope, vd = (
        cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    C, qr = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    out: dict[str, torch.Tensor] = {}

    def lin(name: str, rows: int, cols: int) -> None:
        out[f"{name}.weight"] = _bf16(rng.standard_normal((rows, cols)) * cols**-0.5)

    def norm(name: str, width: int) -> None:
        out[f"{name}.weight"] = _bf16(1.0 + NORM_NOISE * rng.standard_normal(width))

    def layer(i: int) -> None:
        p = f"model.layers.{i}."
        norm(f"{p}input_layernorm", H)
        norm(f"{p}post_attention_layernorm", H)
        a = f"{p}self_attn."
        if qr is None:
            lin(f"{a}q_proj", heads * (nope + rope), H)
        else:
            lin(f"{a}q_a_proj", qr, H)
            norm(f"{a}q_a_layernorm", qr)
            lin(f"{a}q_b_proj", heads * (nope + rope), qr)
        lin(f"{a}kv_a_proj_with_mqa", C + rope, H)
        norm(f"{a}kv_a_layernorm", C)
        lin(f"{a}kv_b_proj", heads * (nope + vd), C)
        lin(f"{a}o_proj", H, heads * vd)
        m = f"{p}mlp."
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            lin(f"{m}gate_proj", inter, H)
            lin(f"{m}up_proj", inter, H)
            lin(f"{m}down_proj", H, inter)
            return
        inter, E = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
        lin(f"{m}gate", E, H)
        out[f"{m}gate.e_score_correction_bias"] = torch.from_numpy(
            (BIAS_STD * rng.standard_normal(E)).astype(np.float32)
        )
        for e in range(E):
            lin(f"{m}experts.{e}.gate_proj", inter, H)
            lin(f"{m}experts.{e}.up_proj", inter, H)
            lin(f"{m}experts.{e}.down_proj", H, inter)
        width = cfg["n_shared_experts"] * inter
        lin(f"{m}shared_experts.gate_proj", width, H)
        lin(f"{m}shared_experts.up_proj", width, H)
        lin(f"{m}shared_experts.down_proj", H, width)

    out["model.embed_tokens.weight"] = _bf16(rng.standard_normal((V, H)))
    norm("model.norm", H)
    lin("lm_head", V, H)
    for i in range(cfg["num_hidden_layers"]):
        layer(i)
    for d in range(cfg["num_nextn_predict_layers"]):
        i = cfg["num_hidden_layers"] + d
        p = f"model.layers.{i}."
        out[f"{p}embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        norm(f"{p}enorm", H)
        norm(f"{p}hnorm", H)
        lin(f"{p}eh_proj", H, 2 * H)
        norm(f"{p}shared_head.norm", H)
        lin(f"{p}shared_head.head", V, H)
        layer(i)
    return out


# ------------------------------------------------------------------------------------------------- oracle


def load_oracle(folder: Path, cfg: dict[str, Any]) -> Any:
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    mtp_prefixes = tuple(
        f"model.layers.{cfg['num_hidden_layers'] + d}." for d in range(cfg["num_nextn_predict_layers"])
    )
    if info["missing_keys"]:
        raise RuntimeError(f"transformers reports missing keys: {sorted(info['missing_keys'])}")
    stray = [k for k in info["unexpected_keys"] if not k.startswith(mtp_prefixes)]
    if stray:
        raise RuntimeError(f"transformers reports unexpected non-MTP keys: {sorted(stray)}")
    if info.get("mismatched_keys"):
        raise RuntimeError(f"transformers reports mismatched keys: {info['mismatched_keys']}")
    return model.eval()


def build_mtp(
    model: Any, tensors: dict[str, torch.Tensor], cfg: dict[str, Any], depth: int
) -> dict[str, Any]:
    """The MTP layer as transformers modules, weights copied from the checkpoint tensors."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    config = model.config
    index = cfg["num_hidden_layers"] + depth
    p = f"model.layers.{index}."
    layer = DeepseekV3DecoderLayer(config, layer_idx=index).float().eval()
    state = {k[len(p) :]: v.float() for k, v in tensors.items() if k.startswith(p)}
    E = cfg["n_routed_experts"]
    m = "mlp.experts."
    gate_up = torch.stack(
        [
            torch.cat([state.pop(f"{m}{e}.gate_proj.weight"), state.pop(f"{m}{e}.up_proj.weight")])
            for e in range(E)
        ]
    )
    down = torch.stack([state.pop(f"{m}{e}.down_proj.weight") for e in range(E)])
    state[f"{m}gate_up_proj"] = gate_up
    state[f"{m}down_proj"] = down
    head_keys = (
        "embed_tokens.weight",
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
    )
    extra = {k: state.pop(k) for k in head_keys}
    missing, unexpected = layer.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"MTP layer {index}: missing {missing}, unexpected {unexpected}")
    H, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    enorm, hnorm, head_norm = (DeepseekV3RMSNorm(H, eps=eps) for _ in range(3))
    enorm.weight.data.copy_(extra["enorm.weight"])
    hnorm.weight.data.copy_(extra["hnorm.weight"])
    head_norm.weight.data.copy_(extra["shared_head.norm.weight"])
    return {
        "layer": layer,
        "embed": extra["embed_tokens.weight"],
        "enorm": enorm,
        "hnorm": hnorm,
        "eh_proj": extra["eh_proj.weight"],
        "head_norm": head_norm,
        "head": extra["shared_head.head.weight"],
    }


def mtp_logits(model: Any, mtp: dict[str, Any], hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """``shared_head(layer(eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])))`` over whole sequences (causal)."""
    B, T = next_ids.shape
    e = mtp["enorm"](torch.nn.functional.embedding(next_ids, mtp["embed"]))
    x = torch.nn.functional.linear(torch.cat([e, mtp["hnorm"](hidden)], dim=-1), mtp["eh_proj"])
    positions = torch.arange(T)[None].expand(B, T)
    pos_emb = model.model.rotary_emb(x, positions)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, T, T)
    x = mtp["layer"](x, attention_mask=mask, position_ids=positions, position_embeddings=pos_emb)
    if isinstance(x, tuple):
        x = x[0]
    return torch.nn.functional.linear(mtp["head_norm"](x), mtp["head"])


# ------------------------------------------------------------------------------------------------- checks


@torch.no_grad()
def routing_gaps(gate: Any, x: torch.Tensor) -> tuple[float, float]:
    """Smallest group-boundary and expert-boundary gaps of the router ``gate`` for inputs ``x [..., H]``."""
    x = x.reshape(-1, x.shape[-1]).double()
    scores = torch.sigmoid(x @ gate.weight.double().T)
    choice = scores + gate.e_score_correction_bias.double()
    n_group, topk_group, k = gate.num_group, gate.topk_group, gate.top_k
    per = choice.shape[-1] // n_group
    group_scores = choice.view(-1, n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
    sorted_groups = group_scores.sort(dim=-1, descending=True)[0]
    group_gap = float("inf")
    if topk_group < n_group:
        group_gap = float((sorted_groups[:, topk_group - 1] - sorted_groups[:, topk_group]).min())
    keep = group_scores.topk(topk_group, dim=-1)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
    eligible = mask.unsqueeze(-1).expand(-1, n_group, per).reshape(choice.shape)
    masked = choice.masked_fill(~eligible, float("-inf")).sort(dim=-1, descending=True)[0]
    expert_gap = float("inf")
    if k < topk_group * per:
        expert_gap = float((masked[:, k - 1] - masked[:, k]).min())
    return group_gap, expert_gap


def build(name: str, cfg: dict[str, Any], seed: int, out_dir: Path) -> dict[str, Any] | None:
    """Build and check one model with ``seed``; returns the fixture metadata, or None when a check fails."""
    from safetensors.torch import save_file

    tensors = make_weights(cfg, seed)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model = load_oracle(folder, cfg)
        config_text = (folder / "config.json").read_text()
    mtp = build_mtp(model, tensors, cfg, 0)

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg["vocab_size"], (BATCH, PROMPT_LEN), generator=gen)
    captured: list[tuple[Any, torch.Tensor]] = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    gates.append(mtp["layer"].mlp.gate)
    hooks = [
        g.register_forward_hook(lambda mod, args, _out: captured.append((mod, args[0].detach())))
        for g in gates
    ]
    with torch.no_grad():
        logits = model(ids).logits
        res = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        sequence = res.sequences
        decode_logits = torch.stack(res.logits, dim=1)
        captured.clear()
        out = model(sequence, output_hidden_states=False)
        seq_logits = out.logits
        hidden = model.model(sequence).last_hidden_state
        mtp_out = mtp_logits(model, mtp, hidden[:, :-1], sequence[:, 1:])
    for h in hooks:
        h.remove()

    gaps = [routing_gaps(mod, x) for mod, x in captured]
    min_group = min(g for g, _ in gaps)
    min_expert = min(e for _, e in gaps)
    top2 = decode_logits.topk(2, dim=-1)[0]
    min_margin = float((top2[..., 0] - top2[..., 1]).min())
    print(
        f"{name} seed {seed}: group gap {min_group:.2e}, expert gap {min_expert:.2e}, greedy margin {min_margin:.2e}"
    )
    if min_group < MIN_ROUTING_GAP or min_expert < MIN_ROUTING_GAP or min_margin < MIN_GREEDY_MARGIN:
        return None
    generated = sequence[:, PROMPT_LEN:]
    if not torch.equal(generated, decode_logits.argmax(-1)):
        raise RuntimeError("generate's tokens are not the argmax of its logits")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(config_text)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    np.savez_compressed(
        out_dir / "reference.npz",
        input_ids=ids.numpy().astype(np.int32),
        logits=logits.numpy().astype(np.float32),
        generated=generated.numpy().astype(np.int32),
        decode_logits=decode_logits.numpy().astype(np.float32),
        sequence=sequence.numpy().astype(np.int32),
        sequence_logits=seq_logits.numpy().astype(np.float32),
        mtp_logits=mtp_out.numpy().astype(np.float32),
    )
    return {
        "seed": seed,
        "rope_attention_scaling": float(model.model.rotary_emb.attention_scaling),
        "softmax_scale": float(model.model.layers[0].self_attn.scaling),
        "min_group_gap": min_group,
        "min_expert_gap": min_expert,
        "min_greedy_margin": min_margin,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "v3")
    parser.add_argument("--max-seeds", type=int, default=50)
    args = parser.parse_args(argv)
    import transformers

    torch.manual_seed(0)
    meta: dict[str, Any] = {
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "batch": BATCH,
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "min_routing_gap": MIN_ROUTING_GAP,
        "min_greedy_margin": MIN_GREEDY_MARGIN,
        "models": {},
    }
    for name, cfg in MODELS.items():
        for seed in range(args.max_seeds):
            info = build(name, copy.deepcopy(cfg), seed, args.out / name)
            if info is not None:
                meta["models"][name] = info
                break
        else:
            raise RuntimeError(f"{name}: no seed below {args.max_seeds} passes the margin checks")
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
