#!/usr/bin/env python3
"""DeepSeek-V2-Lite-shaped random checkpoints, their Hugging Face transformers oracle, and
transformers as the speed-floor peer: the mid-size benchmark and accuracy model of mlaserve.

Run on the GPU machine (torch + CUDA, transformers 5, safetensors; no tokenizer needed):
    python3 bench/model/hf_midsize.py make --out /data/v2lite-27 --layers 27          # ~15.2B params
    python3 bench/model/hf_midsize.py make --out /data/v2lite-4 --layers 4            # accuracy model
    python3 bench/model/hf_midsize.py oracle --model /data/v2lite-4 --out /data/v2lite-4/golden.safetensors \
        --prompt-len 512 --new-tokens 32
    python3 bench/model/hf_midsize.py peer --model /data/v2lite-27 --batches 1,8,64 --context 1024 --steps 16

make: config.json (transformers 5 writes `rope_parameters`, as tests/oracle/make_tiny_models.py's
fixtures do; common/model_config.cc reads it), bf16 *.safetensors in 5 GB shards,
generation_config.json. Built directly on the GPU in bf16.
oracle: safetensors with prompt I32 [L], greedy I32 [K], greedy_logits F32 [K, V] (the logits
each greedy token was chosen from; row 0 is the prompt's last position), prefill_tail_logits
F32 [16, V] (the prompt's last 16 positions). bf16 weights, bf16 compute, bf16 DynamicCache.
peer: prints `hf_peer batch=B context=C decode_ms_median=X tok_s=Y` per batch and
`hf_peer prefill tokens=T ms=X tok_s=Y` for batch 1 at 2048 and 8192 tokens.
"""
import argparse
import os
import statistics
import time

import torch
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.cache_utils import DynamicCache

# DeepSeek-V2-Lite's shape (q_proj instead of q_lora) with DeepseekV3's sigmoid + bias routing.
# max_position_embeddings = factor * original (163840, as V2-Lite): transformers' YaRN derives
# its factor from that ratio when original_max_position_embeddings is given, while the attention
# mscale (and mlaserve) read `factor`; keeping them equal keeps the two in agreement.
V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
    num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=1.0,
    norm_topk_prob=False, first_k_dense_replace=2, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_interleave=True, hidden_act="silu",
    rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                      beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
    initializer_range=0.02, bos_token_id=100000, eos_token_id=100001)


def make(args):
    torch.manual_seed(args.seed)
    config = DeepseekV3Config(num_hidden_layers=args.layers, **V2_LITE)
    torch.set_default_dtype(torch.bfloat16)  # weights born bf16 on the GPU: no fp32 copy
    try:
        with torch.device("cuda"):
            model = DeepseekV3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    std = config.initializer_range
    with torch.no_grad():  # explicit, seeded init (independent of transformers' init order)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
        for layer in model.model.layers:  # DESIGN: oracle fixtures keep the bias non-negative
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.uniform_(0.0, 0.02)
    n_params = sum(p.numel() for p in model.parameters())
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out, max_shard_size="5GB")  # safetensors (the default)
    if not os.path.exists(os.path.join(args.out, "generation_config.json")):
        model.generation_config.save_pretrained(args.out)
    written = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"make: {args.out} layers={args.layers} params={n_params} ({n_params / 1e9:.2f} B) "
          f"bytes_written={written} ({written / 1e9:.2f} GB) "
          f"peak_gpu={torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    print(sorted(os.listdir(args.out)))


def fix_rotary(model):
    """Recomputes the rotary inverse frequencies in fp32 (a bf16 load may have rounded them,
    which drifts the phase with position: a bf16 load rounds them)."""
    rot = model.model.rotary_emb
    was = rot.inv_freq.dtype
    fresh = type(rot)(model.config, device="cuda")  # default dtype is fp32 here
    rot.inv_freq = fresh.inv_freq.to(device="cuda", dtype=torch.float32)
    if hasattr(rot, "original_inv_freq"):
        rot.original_inv_freq = rot.inv_freq.clone()
    rot.attention_scaling = fresh.attention_scaling
    print(f"note: rotary inv_freq loaded as {was}, recomputed in float32; "
          f"attention_scaling={rot.attention_scaling}")


def load(model_dir, attn, experts=None):
    """bf16 on the GPU with attention `attn`, falling back to eager when it is unsupported."""
    for impl in ([attn, "eager"] if attn != "eager" else ["eager"]):
        kw = dict(dtype=torch.bfloat16, attn_implementation=impl)
        if experts:
            kw["experts_implementation"] = experts
        try:
            try:
                model = DeepseekV3ForCausalLM.from_pretrained(model_dir, device_map="cuda", **kw)
            except ImportError:  # device_map without accelerate: load on the CPU, then move
                model = DeepseekV3ForCausalLM.from_pretrained(model_dir, **kw).to("cuda")
        except (ValueError, ImportError) as e:
            if impl == "eager":
                raise
            print(f"note: attn_implementation={impl} unavailable ({e}); falling back to eager")
            continue
        print(f"note: attn_implementation={impl}"
              + (f" experts_implementation={experts}" if experts else ""))
        fix_rotary(model)
        return model.eval(), impl


def random_ids(shape, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=gen).to("cuda")


@torch.inference_mode()
def oracle(args):
    model, impl = load(args.model, args.attn)
    if args.fp32:
        # The exact oracle: the same bf16 weights, widened, and fp32 compute and KV cache (what
        # mlaserve's CPU reference matches to ~1e-5); the bf16 runs of both sides are then two
        # different roundings of it.
        model = model.float()
        fix_rotary(model)
    vocab = model.config.vocab_size
    if args.prompt_text:
        # A real prompt for a trained model (models/train/train_tiny_en.py --preset midsize):
        # the text through the model's own tokenizer, cut to --prompt-len tokens.
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        ids = torch.tensor([tok.encode(args.prompt_text).ids[:args.prompt_len]], device="cuda")
    else:
        ids = random_ids((1, args.prompt_len), vocab, args.seed)
    tail = min(16, args.prompt_len)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=tail)
    tail_logits = out.logits[0, -tail:].float()
    last = tail_logits[-1]
    tokens, logits = [], []
    for k in range(args.new_tokens):
        nxt = int(torch.argmax(last))
        tokens.append(nxt)
        logits.append(last.clone())
        if k + 1 < args.new_tokens:
            step = torch.tensor([[nxt]], device="cuda")
            out = model(input_ids=step, past_key_values=cache, use_cache=True)
            last = out.logits[0, -1].float()
    tensors = {
        "prompt": ids[0].to(torch.int32).cpu().contiguous(),
        "greedy": torch.tensor(tokens, dtype=torch.int32),
        "greedy_logits": torch.stack(logits).cpu().contiguous(),
        "prefill_tail_logits": tail_logits.cpu().contiguous(),
    }
    meta = {"seed": str(args.seed), "attn_implementation": impl,
            "prompt": "text" if args.prompt_text else "random ids",
            "dtype": "float32" if args.fp32 else "bfloat16",
            "kv_cache": "DynamicCache " + ("fp32" if args.fp32 else "bf16"), "transformers": transformers.__version__,
            "torch": torch.__version__, "model": os.path.abspath(args.model)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    save_file(tensors, args.out, metadata=meta)
    print(f"oracle: wrote {args.out}; prompt_len={args.prompt_len} "
          f"peak_gpu={torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    print("greedy:", tokens)


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - t0) * 1e3


def decode_case(model, batch, context, steps, seed):
    ids = random_ids((batch, context), model.config.vocab_size, seed)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    del ids, out

    def step():
        o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        return o.logits[:, -1].argmax(-1, keepdim=True)

    nxt, _ = timed(step)  # warm-up step, not counted
    times = []
    for _ in range(steps):
        nxt, ms = timed(step)
        times.append(ms)
    ms = statistics.median(times)
    print(f"hf_peer batch={batch} context={context} decode_ms_median={ms:.2f} "
          f"tok_s={batch / (ms / 1e3):.1f}", flush=True)


def prefill_case(model, tokens, seed):
    ids = random_ids((1, tokens), model.config.vocab_size, seed)

    def fwd():
        cache = DynamicCache(config=model.config)
        return model(input_ids=ids, past_key_values=cache, use_cache=True,
                     logits_to_keep=1).logits

    timed(fwd)  # warm-up
    _, ms = timed(fwd)
    print(f"hf_peer prefill tokens={tokens} ms={ms:.1f} tok_s={tokens / (ms / 1e3):.1f}",
          flush=True)


@torch.inference_mode()
def peer(args):
    model, impl = load(args.model, args.attn, args.experts)
    print(f"hf_peer note: transformers {transformers.__version__} attn={impl} "
          f"gpu={torch.cuda.get_device_name()}", flush=True)
    cases = [(f"batch={b} context={args.context}", decode_case,
              (model, b, args.context, args.steps, args.seed))
             for b in (int(x) for x in args.batches.split(","))]
    cases += [(f"prefill tokens={t}", prefill_case, (model, t, args.seed))
              for t in (int(x) for x in args.prefill.split(","))]
    for label, fn, fn_args in cases:
        try:
            fn(*fn_args)
        except torch.cuda.OutOfMemoryError:
            print(f"hf_peer {label} oom", flush=True)
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write a random V2-Lite-shaped bf16 checkpoint")
    m.add_argument("--out", required=True)
    m.add_argument("--layers", type=int, required=True)
    m.add_argument("--seed", type=int, default=1234)
    o = sub.add_parser("oracle", help="greedy logits of a random prompt, bf16 on the GPU")
    o.add_argument("--model", required=True)
    o.add_argument("--out", required=True)
    o.add_argument("--prompt-len", type=int, required=True)
    o.add_argument("--new-tokens", type=int, required=True)
    o.add_argument("--seed", type=int, default=1234)
    o.add_argument("--prompt-text", default=None,
                   help="tokenize this text with the model's tokenizer.json instead of random ids")
    o.add_argument("--attn", default="eager", help="eager (default) or sdpa")
    o.add_argument("--fp32", action="store_true",
                   help="compute (and cache) in fp32 on the bf16 weights: the exact oracle")
    p = sub.add_parser("peer", help="transformers decode/prefill speed on this GPU")
    p.add_argument("--model", required=True)
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prefill", default="2048,8192", help="batch-1 prefill lengths")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--attn", default="sdpa", help="sdpa (default; eager if unsupported)")
    p.add_argument("--experts", default=None,
                   help="transformers experts_implementation, e.g. grouped_mm (default: its own)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    {"make": make, "oracle": oracle, "peer": peer}[args.cmd](args)


if __name__ == "__main__":
    main()
