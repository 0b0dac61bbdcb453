#!/usr/bin/env python3
"""Writes the two quantized checkpoint layouts users hold, from a BF16 DeepSeek-V3 folder, with an
implementation independent of mlaserve's (issue 21), and their golden outputs from transformers:

    python3 tests/oracle/quantized_checkpoints.py --base models/tiny-en \
        --fp8 tests/fixtures/models/tiny-en-fp8 --int4 tests/fixtures/models/tiny-en-int4

--fp8: DeepSeek-V3/R1's FP8 layout. config.json quantization_config {"quant_method": "fp8",
  "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"} (the releases'
  own); every linear of attention, dense MLPs, shared and routed experts quantized (not the
  embedding, lm_head, norms or the router): `weight` float8_e4m3fn [out, in] and
  `weight_scale_inv` fp32 [ceil(out/128), ceil(in/128)] with w = fp8 * scale_inv. The quantizer is
  DeepSeek-V3's published inference/kernel.py weight_quant recipe, written here in torch from its
  description: per 128x128 block (partial blocks at the edges, as kv_a_proj_with_mqa's 576 rows
  need) s = amax / 448, fp8 = (w / s) rounded to e4m3 by torch's cast (round to nearest even);
  a zero block gets s = 1.
--int4: Kimi-K2 Thinking / K2.5's compressed-tensors layout, "pack-quantized", group 32,
  symmetric; only the routed experts quantized (the release's ignore list): weight_packed int32
  [out, ceil(in/8)] (column c in word c/8 at bits 4*(c%8), stored as q + 8), weight_scale bf16
  [out, in/32], weight_shape int32 [2]. The scale is compressed-tensors' symmetric min-max
  observer's: amax / ((q_max - q_min) / 2) = amax / 7.5, q = round(w / s) clamped to [-8, 7]. The
  packer is written from the format's description (compressed-tensors' pack_to_int32 docstring and
  its unpack_from_int32) and checked on a hand-computed word below.

For each layout the script dequantizes its own output (fp32: fp8 * scale_inv, q * bf16 scale),
runs transformers' DeepseekV3ForCausalLM in fp32 (eager) on the base model with those weights, and
writes golden.safetensors in the fixture format of tests/oracle/make_tiny_models.py (p{i}.ids,
p{i}.logits for the base fixture's prompts, p2.greedy, p2.greedy_logits, p2.greedy_margins).
For FP8 it also loads the written folder through transformers' own FP8 support (FineGrainedFP8,
which reads DeepSeek's layout; dequantize=True where the version has it) and reports how its
logits compare: a check, independent of this script's dequantization, that the layout is the one
transformers reads.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_tiny_models import greedy  # noqa: E402  the one greedy loop of every fixture

BLOCK = 128
GROUP = 32
FP8_MAX = 448.0


def load_base(base):
    state = {}
    for f in sorted(os.listdir(base)):
        if f.startswith("model") and f.endswith(".safetensors"):
            state.update(load_file(os.path.join(base, f)))
    return state


def linear_modules(state):
    """Every 2-D `.weight` of a linear (not the embedding, lm_head, norms or the router)."""
    out = []
    for k, v in state.items():
        if not k.endswith(".weight") or v.dim() != 2:
            continue
        m = k[: -len(".weight")]
        if m.endswith("embed_tokens") or m == "lm_head" or m.endswith(".mlp.gate") or "norm" in m:
            continue
        out.append(m)
    return sorted(out)


# ---- FP8 block-128 ------------------------------------------------------------------------------

def fp8_quantize(w):
    w = w.float()
    rows, cols = w.shape
    gr, gc = -(-rows // BLOCK), -(-cols // BLOCK)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = float(blk.abs().max())
            scale = amax / FP8_MAX if amax > 0 else 1.0
            s[i, j] = scale
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / scale).to(torch.float8_e4m3fn)
    return q, s


def fp8_dequantize(q, s):
    rows, cols = q.shape
    full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.float() * full


# ---- INT4 pack-quantized ------------------------------------------------------------------------

def int4_pack(q):
    """q int [rows, cols] in [-8, 7] -> int32 [rows, ceil(cols/8)]; column 8k in the lowest nibble."""
    rows, cols = q.shape
    words = -(-cols // 8)
    u = torch.zeros(rows, words * 8, dtype=torch.int64)
    u[:, :cols] = q.long() + 8
    u = u.view(rows, words, 8)
    packed = torch.zeros(rows, words, dtype=torch.int64)
    for j in range(8):
        packed |= u[:, :, j] << (4 * j)
    # As int32 bit patterns (a word whose top nibble is >= 8 is negative).
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)
    return packed.to(torch.int32)


def int4_unpack(packed, cols):
    p = packed.long() & 0xFFFFFFFF
    nib = torch.stack([(p >> (4 * j)) & 0xF for j in range(8)], dim=-1).view(p.shape[0], -1)
    return nib[:, :cols] - 8


def int4_check_packer():
    # Hand-computed: q = [1, -1, 7, -8, 0, 2, 3, -2] -> q + 8 = [9, 7, 15, 0, 8, 10, 11, 6], nibble j
    # at bits 4j: 0x6BA80F79, as int32 0x6BA80F79 = 1806176121 (top nibble 6 < 8: positive).
    q = torch.tensor([[1, -1, 7, -8, 0, 2, 3, -2]])
    assert int(int4_pack(q)[0, 0]) == 0x6BA80F79, hex(int(int4_pack(q)[0, 0]))
    # A negative word: q = -1 in column 7 -> nibble 7 = 7; q = 7 in column 7 -> 15 -> bit 31 set.
    q2 = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 7]])
    assert int(int4_pack(q2)[0, 0]) == 0xF8888888 - 2 ** 32
    r = torch.randint(-8, 8, (5, 77))
    assert torch.equal(int4_unpack(int4_pack(r), 77), r)


def int4_quantize(w):
    w = w.float()
    rows, cols = w.shape
    assert cols % GROUP == 0, f"{cols} columns do not split into groups of {GROUP}"
    g = w.view(rows, cols // GROUP, GROUP)
    amax = g.abs().amax(dim=-1)
    scale = (amax / 7.5).to(torch.bfloat16)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int64).view(rows, cols)
    return int4_pack(q), scale


def int4_dequantize(packed, scale, cols):
    q = int4_unpack(packed, cols).float()
    return q * scale.float().repeat_interleave(GROUP, dim=1)


# ---- goldens ------------------------------------------------------------------------------------

def run_golden(base_dir, deq_state, base_golden):
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(base_dir):
            if f in ("config.json", "generation_config.json"):
                shutil.copy(os.path.join(base_dir, f), tmp)
        save_file({k: v.float().contiguous() for k, v in deq_state.items()},
                  os.path.join(tmp, "model.safetensors"))
        model = DeepseekV3ForCausalLM.from_pretrained(tmp, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    out = {}
    with torch.no_grad():
        for i in range(3):
            ids = base_golden[f"p{i}.ids"].long()
            out[f"p{i}.ids"] = ids.to(torch.int32)
            out[f"p{i}.logits"] = model(input_ids=ids[None]).logits[0].float().contiguous()
        toks, glogits, margins = greedy(model, base_golden["p2.ids"].long())
    out["p2.greedy"] = torch.tensor(toks, dtype=torch.int32)
    out["p2.greedy_logits"] = glogits.contiguous()
    out["p2.greedy_margins"] = torch.tensor(margins, dtype=torch.float32)
    return out, min(margins)


def copy_side_files(base, dst, quant_config):
    os.makedirs(dst, exist_ok=True)
    for f in ("generation_config.json",):  # the tests read token ids, not the tokenizer
        if os.path.exists(os.path.join(base, f)):
            shutil.copy(os.path.join(base, f), dst)
    cfg = json.load(open(os.path.join(base, "config.json")))
    cfg["quantization_config"] = quant_config
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)


def transformers_fp8_check(dst, ours):
    """Loads the FP8 folder through transformers' own FP8 support (first dequantized, then as
    pre-quantized FP8 with its w8a8 kernels); returns a line for the log per mode."""
    from transformers import FineGrainedFP8Config
    lines = []
    for mode in ("dequantize=True", "pre-quantized"):
        try:
            kwargs = {}
            if mode == "dequantize=True":
                kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
            model = DeepseekV3ForCausalLM.from_pretrained(dst, dtype=torch.bfloat16,
                                                          device_map="cuda", **kwargs).eval()
            parts = []
            with torch.no_grad():
                for i in range(3):
                    ids = ours[f"p{i}.ids"].long().cuda()
                    got = model(input_ids=ids[None]).logits[0].float().cpu()
                    ref = ours[f"p{i}.logits"]
                    rel = float((got - ref).abs().max() / ref.abs().max())
                    top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                    parts.append(f"p{i}: rel {rel:.3g} top1 {top1:.3f}")
            lines.append(f"transformers FP8 load ({mode}, bf16) vs this oracle: " + "; ".join(parts))
            del model
        except Exception as e:  # reported, not fatal: the golden does not depend on it
            lines.append(f"transformers FP8 load ({mode}) failed: {type(e).__name__}: "
                         + str(e).strip().splitlines()[-1][:300])
    return " | ".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--fp8")
    ap.add_argument("--int4")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(8)
    int4_check_packer()
    base = load_base(args.base)
    base_golden = load_file(os.path.join(args.base, "golden.safetensors"))
    modules = linear_modules(base)
    report = {}
    if args.fp8:
        state, deq = {}, {}
        for k, v in base.items():
            state[k] = v
            deq[k] = v.float()
        worst = 0.0
        for m in modules:
            w = base[m + ".weight"]
            q, s = fp8_quantize(w)
            state[m + ".weight"] = q
            state[m + ".weight_scale_inv"] = s
            d = fp8_dequantize(q, s)
            worst = max(worst, float((d - w.float()).abs().max() / w.float().abs().max()))
            deq[m + ".weight"] = d
        assert worst < 2 ** -3, worst  # e4m3: 3 mantissa bits, relative step <= 2^-3 at a block's top
        copy_side_files(args.base, args.fp8, {"activation_scheme": "dynamic", "fmt": "e4m3",
                                              "quant_method": "fp8",
                                              "weight_block_size": [BLOCK, BLOCK]})
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(args.fp8, "model.safetensors"), metadata={"format": "pt"})
        golden, margin = run_golden(args.base, deq, base_golden)
        check = transformers_fp8_check(args.fp8, golden)
        save_file(golden, os.path.join(args.fp8, "golden.safetensors"),
                  metadata={"min_greedy_margin": repr(margin), "modules": str(len(modules)),
                            "writer": "tests/oracle/quantized_checkpoints.py (DeepSeek weight_quant)",
                            "transformers_check": check})
        report["fp8"] = {"modules": len(modules), "max_rel_weight_error": worst,
                         "min_greedy_margin": margin, "transformers_check": check}
    if args.int4:
        experts = [m for m in modules if ".mlp.experts." in m]
        state, deq = {}, {}
        for k, v in base.items():
            state[k] = v
            deq[k] = v.float()
        worst = 0.0
        for m in experts:
            w = base[m + ".weight"]
            packed, scale = int4_quantize(w)
            del state[m + ".weight"]
            state[m + ".weight_packed"] = packed
            state[m + ".weight_scale"] = scale
            state[m + ".weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
            d = int4_dequantize(packed, scale, w.shape[1])
            worst = max(worst, float((d - w.float()).abs().max() / w.float().abs().max()))
            deq[m + ".weight"] = d
        assert worst < 0.1, worst  # half a step of amax/7.5 at most: 1/15 of a group's amax
        copy_side_files(args.base, args.int4, {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": None, "output_activations": None,
                "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP,
                            "symmetric": True, "dynamic": False, "actorder": None,
                            "observer": "minmax"}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                       "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]})
        save_file({k: v.contiguous() for k, v in state.items()},
                  os.path.join(args.int4, "model.safetensors"), metadata={"format": "pt"})
        golden, margin = run_golden(args.base, deq, base_golden)
        save_file(golden, os.path.join(args.int4, "golden.safetensors"),
                  metadata={"min_greedy_margin": repr(margin), "modules": str(len(experts)),
                            "writer": "tests/oracle/quantized_checkpoints.py (compressed-tensors pack-quantized)"})
        report["int4"] = {"modules": len(experts), "max_rel_weight_error": worst,
                          "min_greedy_margin": margin}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
