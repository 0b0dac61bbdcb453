"""PyTorch peer of bench/mla/mla_decode_bench.cu: the same absorbed-MLA decode written as
framework ops (gather the paged rows, dequantize, matmul, softmax, matmul) on the same GPU.

Same configurations, same byte count (KV rows in the format + q + out), same cold-L2 rotation
(several pools, >= 256 MB together), timed with CUDA events around CUDA-graph replays, and the
device-to-device copy bandwidth measured in the same process. Configurations whose
intermediates would not fit in ~100 GB are skipped. Prints CSV lines like the C++ bench.
"""
import argparse
import math
import sys

import torch

ROW_BYTES = {"bf16": 1152, "fp8": 576, "fp8_tiled": 656}


def copy_bandwidth():
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    b = torch.empty_like(a)
    ts = []
    for i in range(12):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        if i >= 2:
            ts.append(e0.elapsed_time(e1))
    ts.sort()
    del a, b
    return 2 * n / (ts[len(ts) // 2] * 1e-3)


def random_pool(fmt, num_blocks, gen):
    """Random finite rows in the format's bytes: [num_blocks, 64, row_bytes] uint8."""
    rb = ROW_BYTES[fmt]
    if fmt == "bf16":
        x = (torch.randn(num_blocks, 64, 576, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        return x.view(torch.uint8)
    lat = (torch.rand(num_blocks, 64, 576 if fmt == "fp8" else 512, device="cuda", generator=gen)
           * 800 - 400).to(torch.float8_e4m3fn).view(torch.uint8)
    if fmt == "fp8":
        return lat
    pool = torch.empty(num_blocks, 64, rb, dtype=torch.uint8, device="cuda")
    pool[..., :512] = lat
    pool[..., 512:528] = torch.full((num_blocks, 64, 4), 2.0 ** -4, device="cuda").view(torch.uint8)
    pool[..., 528:] = torch.randn(num_blocks, 64, 64, device="cuda", generator=gen).to(
        torch.bfloat16).view(torch.uint8)
    return pool


def decode(q, pool, block_table, fmt, kv_scale, softmax_scale):
    """q [B, H, 576] bf16; pool [N, 64, RB] uint8; block_table [B, nb] -> out [B, H, 512] bf16."""
    b = q.shape[0]
    rows = pool[block_table].view(b, -1, pool.shape[-1])  # [B, L, RB] gather of the paged rows
    if fmt == "bf16":
        kv = rows.view(torch.bfloat16)
    elif fmt == "fp8":
        kv = (rows.view(torch.float8_e4m3fn).to(torch.float32) * kv_scale).to(torch.bfloat16)
    else:
        lat = rows[..., :512].view(torch.float8_e4m3fn).to(torch.float32)
        scales = rows[..., 512:528].contiguous().view(torch.float32)  # [B, L, 4]
        lat = (lat.view(b, -1, 4, 128) * scales.unsqueeze(-1)).view(b, -1, 512)
        rope = rows[..., 528:].contiguous().view(torch.bfloat16)
        kv = torch.cat([lat.to(torch.bfloat16), rope], dim=-1)
    s = torch.matmul(q, kv.transpose(1, 2)).float() * softmax_scale  # [B, H, L]
    p = torch.softmax(s, dim=-1).to(torch.bfloat16)
    return torch.matmul(p, kv[..., :512])


def time_config(fmt, heads, batch, context):
    rb = ROW_BYTES[fmt]
    nb = (context + 63) // 64
    num_blocks = batch * nb
    pool_bytes = num_blocks * 64 * rb
    # Peak intermediates: gathered rows + dequantized bf16 rows (+ fp32 for fp8) + scores fp32.
    est = num_blocks * 64 * (rb + 1152 + (2304 if fmt != "bf16" else 0)) + batch * heads * context * 10
    if est + pool_bytes > 100e9:
        return None
    copies = min(512, max(1, (256 << 20) // pool_bytes + 1))
    gen = torch.Generator(device="cuda").manual_seed(batch * 131 + context)
    pools = [random_pool(fmt, num_blocks, gen) for _ in range(copies)]
    block_table = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, nb)
    q = torch.randn(batch, heads, 576, device="cuda", generator=gen).to(torch.bfloat16)
    args = (0.05, 0.1352 * 0.1352 / 0.0417 / 24.0)
    for pool in pools[:1]:
        decode(q, pool, block_table, fmt, *args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for pool in pools:
            out = decode(q, pool, block_table, fmt, *args)
    g.replay()
    torch.cuda.synchronize()
    ts, total = [], 0.0
    while len(ts) < 5 or (total < 100.0 and len(ts) < 100):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
        total += ts[-1]
    ts.sort()
    us = ts[len(ts) // 2] * 1e3 / copies
    nbytes = batch * context * rb + batch * heads * (576 + 512) * 2
    del g, pools, out
    torch.cuda.empty_cache()
    return us, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,8,32,64,128")
    ap.add_argument("--context", default="1024,8192,32768,131072")
    ap.add_argument("--heads", default="8,16,64,128")
    ap.add_argument("--format", default="bf16,fp8,fp8_tiled")
    a = ap.parse_args()
    bw = copy_bandwidth()
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()} copy {bw / 1e9:.0f} GB/s",
          file=sys.stderr)
    print("impl,format,heads,batch,context,variant,us,bytes,gbps,frac_copy,copy_gbps")
    for fmt in a.format.split(","):
        for heads in map(int, a.heads.split(",")):
            for batch in map(int, a.batch.split(",")):
                for context in map(int, a.context.split(",")):
                    try:
                        r = time_config(fmt, heads, batch, context)
                    except torch.OutOfMemoryError:
                        r = None
                        torch.cuda.empty_cache()
                    if r is None:
                        print(f"torch,{fmt},{heads},{batch},{context},torch,nan,nan,nan,nan,{bw / 1e9:.1f}")
                        continue
                    us, nbytes = r
                    gbps = nbytes / (us * 1e-6) / 1e9
                    print(f"torch,{fmt},{heads},{batch},{context},torch,{us:.2f},{nbytes},{gbps:.1f},"
                          f"{gbps * 1e9 / bw:.3f},{bw / 1e9:.1f}", flush=True)


if __name__ == "__main__":
    main()
