#!/usr/bin/env python3
"""Independent oracle for mlaserve's NVFP4 quantizer and NVFP4 model.

    python3 tests/oracle/nvfp4_oracle.py --base tests/fixtures/models/kimi-tiny \
        --nvfp4 tests/fixtures/models/kimi-tiny-nvfp4

--nvfp4 is the output of `mlaserve-quantize --in <base> --out <nvfp4>`. This script:
 1. re-quantizes every NVFP4 weight of the base checkpoint with its own torch implementation of
    NVIDIA ModelOpt's NVFP4 recipe (global scale amax/(6*448); per-16 block scale
    amax/(6*global) cast to float8_e4m3fn; e2m1 rounding by searchsorted over the midpoints
    with ModelOpt's round-half-to-even on the odd boundaries) and asserts that packed codes,
    block scales and global scales are byte-identical to mlaserve's;
 2. dequantizes mlaserve's output with its own code (e2m1 table x float8_e4m3fn x scale_2);
 3. runs transformers (fp32) on the base model with those dequantized expert weights and writes
    <nvfp4>/golden.safetensors: p{i}.ids/p{i}.logits (the base fixture's prompts), p2.greedy,
    p2.greedy_logits, p2.greedy_margins, and deq.<name> = its dequantized fp32 weights for the
    first expert of each MoE layer (mlaserve's own dequantization is compared against them).
"""
import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

# The same greedy loop as the base fixtures (transformers' own KV cache, 32 tokens).
from make_tiny_models import greedy

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def modelopt_quantize(w):
    """NVFP4 as ModelOpt's NVFP4QTensor does it, returning (packed u8, scale u8, global f32)."""
    w = w.float()
    gs = w.abs().max() / (6.0 * 448.0)
    rows, cols = w.shape
    blocks = w.view(rows, cols // 16, 16)
    bamax = blocks.abs().amax(dim=-1)
    s = bamax / (6.0 * gs) if gs > 0 else torch.ones_like(bamax)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp(min=2.0 ** -9)
    s8 = s.to(torch.float8_e4m3fn)
    denom = s8.float().unsqueeze(-1) * gs
    x = blocks / denom if gs > 0 else torch.zeros_like(blocks)
    a = x.abs()
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    ord_ = torch.searchsorted(bounds, a.contiguous(), right=False)  # bounds strictly below a
    odd = (a == 0.75) | (a == 1.75) | (a == 3.5)
    ord_ = ord_ + odd.long()
    codes = (ord_ | ((x < 0).long() << 3)).to(torch.uint8).view(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    return packed, s8.view(torch.uint8).view(rows, cols // 16), gs.float()


def dequantize(packed, scale_u8, gs):
    lo = (packed & 0xF).long()
    hi = (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).view(packed.shape[0], -1)
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = scale_u8.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    return vals * scale * gs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--nvfp4", required=True)
    args = ap.parse_args()
    torch.set_num_threads(8)
    base = {}
    for f in sorted(os.listdir(args.base)):
        if f.startswith("model") and f.endswith(".safetensors"):
            base.update(load_file(os.path.join(args.base, f)))
    ours = {}
    for f in sorted(os.listdir(args.nvfp4)):
        if f.startswith("model") and f.endswith(".safetensors"):
            with safe_open(os.path.join(args.nvfp4, f), "pt") as s:
                for k in s.keys():
                    ours[k] = s.get_tensor(k)
    state = {k: v.float() for k, v in base.items()}
    modules = sorted(k[: -len(".weight_scale")] for k in ours if k.endswith(".weight_scale"))
    assert modules, "no NVFP4 weights in " + args.nvfp4
    deq_keep = {}
    for m in modules:
        packed, scale, gs = ours[m + ".weight"], ours[m + ".weight_scale"], ours[m + ".weight_scale_2"]
        rp, rs, rg = modelopt_quantize(base[m + ".weight"])
        assert torch.equal(rp, packed), f"{m}: packed codes differ from ModelOpt's recipe"
        assert torch.equal(rs, scale.view(torch.uint8)), f"{m}: block scales differ"
        assert float(rg) == float(gs), f"{m}: global scale {float(gs)} vs {float(rg)}"
        deq = dequantize(packed, scale.view(torch.uint8), float(gs))
        w = base[m + ".weight"].float()
        err = (deq - w).abs().max() / w.abs().max()
        assert err < 0.25, f"{m}: dequantized weight off by {err}"  # e2m1 step at the top: 1/6..1/3
        state[m + ".weight"] = deq
        if ".experts.0." in m:
            deq_keep["deq." + m + ".weight"] = deq.contiguous()
    print(f"{len(modules)} NVFP4 weights: codes, scales and global scales identical to the recipe")
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(args.base):
            if f.endswith(".json") and not f.startswith("model.safetensors"):
                shutil.copy(os.path.join(args.base, f), tmp)
        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(tmp, "model.safetensors"))
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    golden = load_file(os.path.join(args.base, "golden.safetensors"))
    out = dict(deq_keep)
    with torch.no_grad():
        for i in range(3):
            ids = golden[f"p{i}.ids"].long()
            out[f"p{i}.ids"] = ids.to(torch.int32)
            out[f"p{i}.logits"] = model(input_ids=ids[None]).logits[0].float().contiguous()
        toks, glogits, margins = greedy(model, golden["p2.ids"].long())
    out["p2.greedy"] = torch.tensor(toks, dtype=torch.int32)
    out["p2.greedy_logits"] = glogits.contiguous()
    out["p2.greedy_margins"] = torch.tensor(margins, dtype=torch.float32)
    save_file(out, os.path.join(args.nvfp4, "golden.safetensors"),
              metadata={"min_greedy_margin": repr(min(margins)), "modules": str(len(modules))})
    print("nvfp4 golden written; min greedy margin", min(margins))


if __name__ == "__main__":
    main()
