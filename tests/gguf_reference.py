"""An independent float64 reference of a Llama-architecture GGUF model, for tests.

It reads the file with the gguf library alone (no hcjax code), keeps llama.cpp's own layout (q/k
rows interleaved per head, rotated as adjacent pairs: llama.cpp's NORM rope) where hcjax undoes
the permutation and rotates halves, and decodes greedily with a plain KV cache in numpy float64.
Agreement with hcjax's loader therefore checks the name mapping, the un-permutation, the config
and the forward together.
"""

from __future__ import annotations

import gguf
import numpy as np


class LlamaReference:
    def __init__(self, path: str):
        r = gguf.GGUFReader(path, "r")
        meta = {k: f.contents() for k, f in r.fields.items()
                if not k.startswith(("GGUF.", "tokenizer.ggml."))}
        arch = meta["general.architecture"]
        assert arch == "llama", arch
        self.layers = int(meta[f"{arch}.block_count"])
        self.heads = int(meta[f"{arch}.attention.head_count"])
        self.kv_heads = int(meta[f"{arch}.attention.head_count_kv"])
        self.eps = float(meta[f"{arch}.attention.layer_norm_rms_epsilon"])
        self.theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        self.w = {}
        for t in r.tensors:
            shape = tuple(int(d) for d in reversed(t.shape))
            self.w[t.name] = np.asarray(
                gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float64
            ).reshape(shape)
        self.d = self.w["token_embd.weight"].shape[1]
        self.head_dim = self.d // self.heads
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

    def _rope_pairs(self, x, pos):
        # x [T, H, D]; rotate (2i, 2i+1) by pos * theta^(-2i/D) (llama.cpp NORM mode).
        dim = x.shape[-1]
        inv = self.theta ** (-np.arange(0, dim, 2) / dim)
        ang = pos[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def _step(self, ids, cache, start):
        """Logits [V] of the last of `ids` at positions start.., appending to the per-layer KV cache."""
        x = self.w["token_embd.weight"][ids]
        pos = np.arange(start, start + len(ids), dtype=np.float64)
        t, hd, group = len(ids), self.head_dim, self.heads // self.kv_heads
        for i in range(self.layers):
            p = f"blk.{i}."
            h = self._norm(x, self.w[p + "attn_norm.weight"])
            q = (h @ self.w[p + "attn_q.weight"].T).reshape(t, self.heads, hd)
            k = (h @ self.w[p + "attn_k.weight"].T).reshape(t, self.kv_heads, hd)
            v = (h @ self.w[p + "attn_v.weight"].T).reshape(t, self.kv_heads, hd)
            q, k = self._rope_pairs(q, pos), self._rope_pairs(k, pos)
            ks, vs = cache.setdefault(i, ([], []))
            ks.append(k)
            vs.append(v)
            kk, vv = np.concatenate(ks), np.concatenate(vs)  # [S, Hkv, D]
            kk, vv = np.repeat(kk, group, axis=1), np.repeat(vv, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, kk) / np.sqrt(hd)
            s_pos = np.arange(kk.shape[0])
            scores = np.where(s_pos[None, None, :] <= pos[None, :, None], scores, -np.inf)
            scores -= scores.max(-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(-1, keepdims=True)
            att = np.einsum("hts,shd->thd", probs, vv).reshape(t, self.heads * hd)
            x = x + att @ self.w[p + "attn_output.weight"].T
            h = self._norm(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        return self._norm(x[-1], self.w["output_norm.weight"]) @ self.out.T

    def last_logits(self, ids) -> np.ndarray:
        return self._step(np.asarray(ids), {}, 0)

    def greedy(self, ids, max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
        cache: dict = {}
        logits = self._step(np.asarray(ids), cache, 0)
        out, pos = [], len(ids)
        for _ in range(max_tokens):
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop:
                break
            logits = self._step(np.asarray([tok]), cache, pos)
            pos += 1
        return out
