#!/usr/bin/env python3
"""Issue 18's question, asked on a CPU: does training the embedded model aware of its KV cache
format raise the top-1 agreement of the fp8 / fp8_tiled caches with the bf16 cache?

A machine without a GPU, PyPI or transformers (this project's 2-core development box) has Debian's
python3-torch (1.13) and, with libopenblas0-pthread, ~40 GFLOP/s. This script fine-tunes the
committed models/tiny-en there for a few hundred small steps, with and without the formats, and
prints the held-out agreement as train_tiny_en.py measures it in-run. It is an experiment to decide
what the GPU training run does, not the way the shipped model is made (train_tiny_en.py, with
transformers' own DeepseekV3ForCausalLM, on the GPU machine, is).

So that nothing depends on transformers here, the model's forward is written out below from
transformers 5.17's modeling_deepseek_v3 (the same semantics mlaserve's CPU model matches): it is
checked first against the committed transformers golden logits (models/tiny-en/golden.safetensors,
p0 and p1, fp32), and the tokenizer (byte-level BPE from tokenizer.json) against the golden's
`heldout.ids` (Hugging Face tokenizers' ids for the first 40 held-out paragraphs). The formats'
rounding is train_tiny_en.py's (checked there bit for bit against kv_cache_format.cc).

    apt-get install python3-torch libopenblas0-pthread
    python3 models/train/train_tiny_en.py corpus --brown BROWN --out /tmp/corpus
    python3 models/train/kv_format_cpu_experiment.py --corpus /tmp/corpus --steps 150 \
        --kv-formats fp8,fp8_tiled --kv-consistency 1 --out /tmp/ft
"""
import argparse
import functools
import json
import math
import os
import random
import re
import struct
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny_en as tte  # noqa: E402  (the corpus, chat examples, formats' rounding)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


# ---------------------------------------------------------------------------------------------
# safetensors without the safetensors package

DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32, "F16": torch.float16}


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        t = torch.frombuffer(bytearray(data[a:b]), dtype=DTYPES[info["dtype"]]) if b > a else \
            torch.zeros(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).clone()
    return out, header.get("__metadata__", {})


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        raw = bytes(t.view(torch.uint8).reshape(-1).tolist()) if t.numel() else b""
        dtype = {v: k for k, v in DTYPES.items()}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def load_model_dir(folder):
    weights = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("model") and name.endswith(".safetensors"):
            weights.update(read_safetensors(os.path.join(folder, name))[0])
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f), weights


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (tokenizers' ByteLevel pre-tokenizer with the GPT-2 regex, then merges by rank)

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Bpe:
    # GPT-2's pattern with \p{L} as [^\W\d_] and \p{N} as \d (Python's re has no \p{}); exact on
    # the ASCII prose here, which the check against tokenizers' ids below confirms.
    PAT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+|_+""")

    def __init__(self, folder):
        with open(os.path.join(folder, "tokenizer.json")) as f:
            t = json.load(f)
        self.vocab = t["model"]["vocab"]
        self.ranks = {tuple(m if isinstance(m, list) else m.split(" ")): i
                      for i, m in enumerate(t["model"]["merges"])}
        self.special = {a["content"]: a["id"] for a in t["added_tokens"]}
        self.split = re.compile("(" + "|".join(map(re.escape, self.special)) + ")")
        self.byte = bytes_to_unicode()

    @functools.lru_cache(maxsize=None)
    def word(self, w):
        parts = [self.byte[b] for b in w.encode("utf-8")]
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), 1 << 30), i)
                     for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return tuple(self.vocab[p] for p in parts)

    def encode(self, text):
        ids = []
        for piece in self.split.split(text):
            if not piece:
                continue
            if piece in self.special:
                ids.append(self.special[piece])
                continue
            for w in self.PAT.findall(piece):
                ids.extend(self.word(w))
        return ids


# ---------------------------------------------------------------------------------------------
# DeepseekV3ForCausalLM's forward (transformers 5.17), fp32, with the cache's rounding as a hook

class Model(torch.nn.Module):
    def __init__(self, cfg, weights, golden_meta, inv_freq):
        super().__init__()
        self.cfg = cfg
        self.p = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(v.float()) for k, v in weights.items()
             if not k.endswith("e_score_correction_bias")})
        self.bias = {k: v.float() for k, v in weights.items() if k.endswith("e_score_correction_bias")}
        self.scale = float(golden_meta["softmax_scale"])
        self.rope_scaling = float(golden_meta["rope_attention_scaling"])
        self.inv_freq = inv_freq.float()
        self.latent_round = self.rope_round = None
        self.ste = False

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def _round(self, fn, t):
        if fn is None:
            return t
        return t + (fn(t) - t).detach() if self.ste else fn(t)

    def rms(self, x, name):
        v = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(v + self.cfg["rms_norm_eps"]) * self.w(name)

    def rope(self, x, T):
        # apply_rotary_pos_emb_interleave: the weights' rope dims are interleaved (x0 y0 x1 y1
        # ...); de-interleave, then rotate_half with cos / sin of cat(freqs, freqs) x scaling.
        d = x.shape[-1]
        x = x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)
        pos = torch.arange(T, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def attn(self, x, li):
        c = self.cfg
        B, T, _ = x.shape
        H, dn, dr, dv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                         c["v_head_dim"])
        pre = f"model.layers.{li}.self_attn."
        q = self.rms(x @ self.w(pre + "q_a_proj.weight").t(), pre + "q_a_layernorm.weight")
        q = (q @ self.w(pre + "q_b_proj.weight").t()).view(B, T, H, dn + dr).transpose(1, 2)
        q_nope, q_rot = q[..., :dn], q[..., dn:]
        kv = x @ self.w(pre + "kv_a_proj_with_mqa.weight").t()
        latent, k_rot = kv[..., :c["kv_lora_rank"]], kv[..., c["kv_lora_rank"]:]
        latent = self._round(self.latent_round, self.rms(latent, pre + "kv_a_layernorm.weight"))
        kvb = (latent @ self.w(pre + "kv_b_proj.weight").t()).view(B, T, H, dn + dv).transpose(1, 2)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]
        q_rot = self.rope(q_rot, T)
        k_rot = self._round(self.rope_round, self.rope(k_rot.view(B, 1, T, dr), T))
        qk = torch.cat([q_nope, q_rot], -1)
        k = torch.cat([k_nope, k_rot.expand(B, H, T, dr)], -1)
        s = (qk @ k.transpose(-1, -2)) * self.scale
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, H * dv)
        return o @ self.w(pre + "o_proj.weight").t()

    def mlp(self, x, pre):
        g = x @ self.w(pre + "gate_proj.weight").t()
        u = x @ self.w(pre + "up_proj.weight").t()
        return (F.silu(g) * u) @ self.w(pre + "down_proj.weight").t()

    def moe(self, x, li):
        c = self.cfg
        pre = f"model.layers.{li}.mlp."
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.sigmoid(x @ self.w(pre + "gate.weight").t())
        choice = scores.detach() + self.bias[pre + "gate.e_score_correction_bias"]
        E, G = c["n_routed_experts"], c["n_group"]
        g = choice.view(-1, G, E // G).topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(g).scatter_(1, g.topk(c["topk_group"], -1).indices, 1.0)
        masked = choice.masked_fill(~keep.repeat_interleave(E // G, 1).bool(), 0.0)
        idx = masked.topk(c["num_experts_per_tok"], -1).indices
        wts = scores.gather(1, idx)
        if c["norm_topk_prob"]:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c["routed_scaling_factor"]
        out = torch.zeros_like(x)
        for e in range(E):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                y = self.mlp(x[rows], pre + f"experts.{e}.")
                out = out.index_add(0, rows, y * wts[rows, slot, None])
        out = out + self.mlp(x, pre + "shared_experts.")
        return out.view(shape)

    def forward(self, ids):
        x = self.w("model.embed_tokens.weight")[ids]
        for li in range(self.cfg["num_hidden_layers"]):
            pre = f"model.layers.{li}."
            x = x + self.attn(self.rms(x, pre + "input_layernorm.weight"), li)
            h = self.rms(x, pre + "post_attention_layernorm.weight")
            x = x + (self.mlp(h, pre + "mlp.") if li < self.cfg["first_k_dense_replace"]
                     else self.moe(h, li))
        return self.rms(x, "model.norm.weight") @ self.w("lm_head.weight").t()

    def formats(self, fmt, ste=False):
        self.latent_round, self.rope_round = tte.kv_format_rounders(fmt)
        self.ste = ste
        return self


def figures(model, rows, batch=16):
    """train_tiny_en.format_figures of this model (fp32, CPU)."""
    model.eval()
    try:
        return tte.format_figures(lambda x, fmt: model.formats(fmt)(x), rows, batch)
    finally:
        model.formats("none")
        model.train()


def rows_of(tok, examples, seed, seq=tte.SEQ):
    rng = random.Random(seed)
    examples = list(examples)
    rng.shuffle(examples)
    stream = []
    for u, a in examples:
        stream.extend(tok.encode(tte.render(u, a)))
    n = len(stream) // (seq + 1)
    return torch.tensor(stream[:n * (seq + 1)], dtype=torch.long).view(n, seq + 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "tiny-en"))
    ap.add_argument("--golden", help="take the rope table and softmax scale from this model's "
                    "golden (a fine-tuned --model has none; its logits are then not checked)")
    ap.add_argument("--corpus", required=True, help="train_tiny_en.py corpus's output folder")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--kv-formats", default="none")
    ap.add_argument("--kv-consistency", type=float, default=0.0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--agreement-rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", help="write the fine-tuned model here (bf16, the committed layout)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    cfg, weights = load_model_dir(args.model)
    golden, meta = read_safetensors(os.path.join(args.golden or args.model, "golden.safetensors"))
    model = Model(cfg, weights, meta, golden["rope.inv_freq"])
    with torch.no_grad():
        for p in ("p0", "p1") if not args.golden else ():
            got = model(golden[f"{p}.ids"].long()[None])[0]
            want = golden[f"{p}.logits"]
            err = float((got - want).abs().max() / want.abs().max())
            print(f"check: {p} logits against transformers' golden, max |diff| / max |logit| "
                  f"{err:.2e}", flush=True)
            if err > 1e-4:
                sys.exit("the forward does not match transformers' golden logits")
    tok = Bpe(args.model)
    held = tte.load_paragraphs(os.path.join(args.corpus, "heldout.txt"))
    ids = tok.encode("\n".join(held[:40]))
    want = golden["heldout.ids"].tolist()
    print(f"check: tokenizer on 40 held-out paragraphs: {len(ids)} ids, equal to tokenizers': "
          f"{ids == want}", flush=True)
    if ids != want:
        sys.exit("the tokenizer does not match Hugging Face tokenizers' ids")

    formats = [f.strip() for f in args.kv_formats.split(",") if f.strip()]
    t0 = time.time()
    train_rows = rows_of(tok, tte.chat_examples(
        tte.load_paragraphs(os.path.join(args.corpus, "train.txt"))), args.seed)
    held_rows = rows_of(tok, tte.chat_examples(held), args.seed)[:args.agreement_rows]
    print(f"data: {train_rows.shape[0]} training rows, {held_rows.shape[0]} held-out rows "
          f"({time.time() - t0:.0f} s); formats per step {formats}, consistency "
          f"{args.kv_consistency}, {args.steps} steps of {args.batch} x {tte.SEQ}, lr {args.lr}",
          flush=True)
    print(f"step 0: {tte.figures_line(figures(model, held_rows))}", flush=True)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train_rows.shape[0], generator=gen)
    start = time.time()
    for step in range(args.steps):
        x = train_rows[order[(step * args.batch) % (order.numel() - args.batch):][:args.batch]]
        fmt = formats[step % len(formats)]
        logits = model.formats(fmt, ste=True)(x[:, :-1]).reshape(-1, cfg["vocab_size"])
        loss = F.cross_entropy(logits, x[:, 1:].reshape(-1))
        if args.kv_consistency > 0 and fmt != "none":
            clean = model.formats("none")(x[:, :-1]).reshape(-1, cfg["vocab_size"])
            loss = 0.5 * (loss + F.cross_entropy(clean, x[:, 1:].reshape(-1)))
            loss = loss + args.kv_consistency * F.kl_div(
                torch.log_softmax(logits, -1), torch.log_softmax(clean, -1), log_target=True,
                reduction="batchmean")
        model.formats("none")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            print(f"step {step + 1} loss {float(loss):.3f} {time.time() - start:.0f} s: "
                  f"{tte.figures_line(figures(model, held_rows))}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tensors = {k.replace("__", "."): v.detach().to(torch.bfloat16) for k, v in model.p.items()}
        tensors.update({k: v.float() for k, v in model.bias.items()})
        write_safetensors(os.path.join(args.out, "model.safetensors"), tensors)
        for name in ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json"):
            with open(os.path.join(args.model, name), "rb") as f, \
                    open(os.path.join(args.out, name), "wb") as g:
                g.write(f.read())
        print("saved", args.out, flush=True)


if __name__ == "__main__":
    main()
