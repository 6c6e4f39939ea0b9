"""An independent NumPy float64 Qwen3 forward: the reference the CPU session is tested against.

Written from the model definition (transformers' modeling_qwen3), not from the engine: full
causal attention over the whole sequence at once (no KV cache, no blocking, no fused layouts),
every product in float64. Weights are a mapping of HuggingFace tensor names to arrays.

Legend: S sequence length, D d_model, Hq/Hkv heads, Dh d_head, F d_ff, V vocab.
"""

from __future__ import annotations

import numpy as np

_LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def random_weights(cfg: dict, seed: int = 0) -> dict:
    """Float32 weights of a Qwen3 model with cfg's shape, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)
    D, Hq, Hkv, Dh, F = cfg["d_model"], cfg["h_q"], cfg["h_kv"], cfg["d_head"], cfg["d_ff"]

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((cfg["vocab"], D)).astype(np.float32)}
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(D)
        w[p + "self_attn.q_proj.weight"] = mat(Hq * Dh, D)
        w[p + "self_attn.k_proj.weight"] = mat(Hkv * Dh, D)
        w[p + "self_attn.v_proj.weight"] = mat(Hkv * Dh, D)
        w[p + "self_attn.q_norm.weight"] = norm(Dh)
        w[p + "self_attn.k_norm.weight"] = norm(Dh)
        w[p + "self_attn.o_proj.weight"] = mat(D, Hq * Dh)
        w[p + "post_attention_layernorm.weight"] = norm(D)
        w[p + "mlp.gate_proj.weight"] = mat(F, D)
        w[p + "mlp.up_proj.weight"] = mat(F, D)
        w[p + "mlp.down_proj.weight"] = mat(D, F)
    w["model.norm.weight"] = norm(D)
    if not cfg.get("tie_word_embeddings", True):
        w["lm_head.weight"] = mat(cfg["vocab"], D)
    return w


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, positions, theta):
    # x (S, H, Dh); rotate-half pairing (i, i + Dh/2), angle p * theta^(-2i/Dh).
    dh = x.shape[-1]
    inv = theta ** (-np.arange(0, dh, 2, dtype=np.float64) / dh)
    ang = positions[:, None].astype(np.float64) * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    rot = np.concatenate([-x2, x1], axis=-1)
    return x * cos + rot * sin


def q8_activations(x):
    """The int8 format's activations, independently of the engine: each row of x, rounded to
    float32, in blocks of 32 quantized with scale amax / 127 (float32 division), rounded half to
    even and clipped to +-127, then dequantized (float64 of q * s)."""
    x32 = np.asarray(x, dtype=np.float32)
    out = np.empty(x32.shape, dtype=np.float64)
    for b0 in range(0, x32.shape[-1], 32):
        blk = x32[..., b0:b0 + 32]
        s = (np.abs(blk).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
        q = np.where(s > 0, np.rint(blk / np.where(s > 0, s, np.float32(1))), 0).clip(-127, 127)
        out[..., b0:b0 + 32] = q.astype(np.float64) * s.astype(np.float64)
    return out


def bf16_activations(x):
    """The bf16 format's activations, independently of the engine: x rounded to float32, then
    to bfloat16 (nearest, ties to even), as float64."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    return r.view(np.float32).astype(np.float64)


def f16_values(x):
    """x rounded to float32, then to IEEE float16 (nearest, ties to even), as float64."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)


def forward(cfg: dict, weights: dict, ids, act=None, kv=None) -> np.ndarray:
    """Logits (S, V) in float64 for every position of ids (S), starting at position 0. act, when
    given, maps every activation matrix on its way into a weight-matrix product (the input of
    q/k/v, o, gate/up, down and the head): q8_activations models the int8 format,
    bf16_activations the bf16 format. kv, when given, maps the keys (after their norm and RoPE)
    and the values as a KV cache holds them: bf16_activations or f16_values."""
    a = act or (lambda t: t)
    c = kv or (lambda t: t)
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    ids = np.asarray(ids, dtype=np.int64)
    S = ids.shape[0]
    Hq, Hkv, Dh = cfg["h_q"], cfg["h_kv"], cfg["d_head"]
    eps, theta = cfg["rms_eps"], cfg["rope_theta"]
    pos = np.arange(S)
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((S, S), -np.inf), k=1)
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        h = a(_rms(x, w[p + "input_layernorm.weight"], eps))
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(S, Hq, Dh)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(S, Hkv, Dh)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(S, Hkv, Dh)
        q = _rope(_rms(q, w[p + "self_attn.q_norm.weight"], eps), pos, theta)
        k = c(_rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, theta))
        v = c(v)
        group = Hq // Hkv
        k = np.repeat(k, group, axis=1)  # query head j reads kv head j // group
        v = np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(Dh) + mask
        scores -= scores.max(axis=-1, keepdims=True)
        pr = np.exp(scores)
        pr /= pr.sum(axis=-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", pr, v).reshape(S, Hq * Dh)
        x = x + a(att) @ w[p + "self_attn.o_proj.weight"].T
        h = a(_rms(x, w[p + "post_attention_layernorm.weight"], eps))
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + a((g / (1.0 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = a(_rms(x, w["model.norm.weight"], eps))
    head = w.get("lm_head.weight") if not cfg.get("tie_word_embeddings", True) else None
    if head is None:
        head = w["model.embed_tokens.weight"]
    return x @ head.T


def greedy(cfg: dict, weights: dict, prompt, n_new: int) -> list:
    """n_new greedy ids after prompt, recomputing the full forward each step (no cache)."""
    ids = list(prompt)
    out = []
    for _ in range(n_new):
        t = int(np.argmax(forward(cfg, weights, ids)[-1]))
        out.append(t)
        ids.append(t)
    return out


def o1_init_(model):
    """Re-initialize a transformers model in place for tests: its own init (std 0.02, unit norms)
    gives near-zero logits that would hide errors; N(0, 1) embeddings, N(0, 1/fan_in) matrices and
    norm weights around 1 give O(1) activations in which every term of the forward counts."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
            else:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model
