#!/usr/bin/env python3
"""BF16 peer of moe_bench: the same expert GEMMs as PyTorch BF16 matmuls (cuBLAS).

Shapes as moe_bench (hidden 7168, intermediate 2048, top-8; 48 local experts of 384 as at EP 8,
and all 256 experts), the same routing distribution (uniform, 8 distinct experts per token; the
draw differs, the counts are reported). Per active expert: h = x_e @ W13_e^T, silu(gate) * up,
y = h @ W2_e^T * w, index_add into the output; decode pads the active experts to one batched
bmm (fewer launches than a loop, the fastest form for 1..16 rows an expert), prefill loops over
experts. The sequence is captured in a CUDA graph and replayed (no Python overhead in the time);
L2 is flushed (256 MB write) before every timed replay. Weights are random bf16: cuBLAS speed does
not depend on the values (the 13% faster-on-zeros effect is avoided by using random data).
"""
import sys

import torch

H, I, K = 7168, 2048, 8
CONFIGS = [("ep8_48_of_384", 384, 48), ("all_256", 256, 256)]
DECODE = [1, 8, 32, 64, 128]
PREFILL = [2048, 8192, 32768]


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def route(tokens, num_experts, gen):
    scores = torch.rand(tokens, num_experts, generator=gen, device="cuda")
    return scores.topk(K, dim=-1).indices  # uniform, distinct


def main():
    quick = "--quick" in sys.argv
    decode_tokens = [] if "--prefill" in sys.argv else DECODE
    dev = torch.device("cuda")
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'config':<14} {'tokens':>6} {'active':>6} {'rows':>7} | {'total_us':>9} "
          f"{'GB/s':>7} | {'TFLOP/s':>8}   (bf16 weight bytes of the active experts)")
    prefill = PREFILL[:1] if quick else PREFILL
    if "--decode" in sys.argv:
        prefill = []
    for name, num_experts, num_local in CONFIGS:
        w13 = torch.randn(num_local, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(num_local, H, I, device=dev, dtype=torch.bfloat16) * 0.02
        for tokens in decode_tokens + prefill:
            x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
            ids = route(tokens, num_experts, gen)
            weights = torch.full((tokens, K), 1.0 / K, device=dev)
            flat = ids.flatten()
            local = flat < num_local
            counts = torch.bincount(flat[local], minlength=num_local).cpu()
            active = [e for e in range(num_local) if counts[e] > 0]
            rows = int(counts.sum())
            tok_of = torch.arange(tokens * K, device=dev) // K
            per_expert = {}
            for e in active:
                sel = (flat == e).nonzero().flatten()
                per_expert[e] = (tok_of[sel], weights.flatten()[sel])
            out = torch.zeros(tokens, H, device=dev, dtype=torch.float32)
            decode = tokens <= 128
            if not active:
                print(f"{name:<14} {tokens:>6} {0:>6} {0:>7} | no local expert routed", flush=True)
                continue
            if decode and active:
                m = max(int(counts[e]) for e in active)
                idx = torch.zeros(len(active), m, dtype=torch.long, device=dev)
                wpad = torch.zeros(len(active), m, device=dev)
                for i, e in enumerate(active):
                    t, w = per_expert[e]
                    idx[i, : len(t)] = t
                    wpad[i, : len(t)] = w
                eids = torch.tensor(active, device=dev)

            def step():
                out.zero_()
                if decode:
                    xe = x[idx]  # [A, m, H]
                    h = torch.bmm(xe, w13[eids].transpose(1, 2))
                    h = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
                    y = torch.bmm(h, w2[eids].transpose(1, 2)).float() * wpad[..., None]
                    out.index_add_(0, idx.flatten(), y.reshape(-1, H))
                else:
                    for e in active:
                        t, w = per_expert[e]
                        h = x[t] @ w13[e].T
                        h = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
                        out.index_add_(0, t, (h @ w2[e].T).float() * w[:, None])

            # Note: decode's w13[eids] gather copies the active weights; the graph below times
            # it, so the peer's decode also streams them twice. We report both with and without
            # (the "gemm" column times only the two bmm calls on pre-gathered weights).
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            if decode:
                w13a, w2a = w13[eids].contiguous(), w2[eids].contiguous()
                xe = x[idx].contiguous()

                def gemm_only():
                    h = torch.bmm(xe, w13a.transpose(1, 2))
                    h = torch.nn.functional.silu(h[..., :I]) * h[..., I:]
                    torch.bmm(h, w2a.transpose(1, 2))

                g2 = torch.cuda.CUDAGraph()
                for _ in range(2):
                    gemm_only()
                torch.cuda.synchronize()
                with torch.cuda.graph(g2):
                    gemm_only()
            reps = 30 if decode else (3 if tokens >= 32768 else 6)
            times, gtimes = [], []
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for it in range(reps + 2):
                flush.fill_(it & 0xff)
                start.record()
                g.replay()
                stop.record()
                torch.cuda.synchronize()
                if it >= 2:
                    times.append(start.elapsed_time(stop) * 1e3)
                if decode:
                    flush.fill_(it & 0xff)
                    start.record()
                    g2.replay()
                    stop.record()
                    torch.cuda.synchronize()
                    if it >= 2:
                        gtimes.append(start.elapsed_time(stop) * 1e3)
            us = median(times)
            wbytes = len(active) * 3 * H * I * 2
            tflops = 2.0 * rows * 3 * H * I / (us * 1e-6) / 1e12
            extra = f"   gemm-only {median(gtimes):8.1f} us {wbytes / (median(gtimes) * 1e-6) / 1e9:6.0f} GB/s" if decode else ""
            print(f"{name:<14} {tokens:>6} {len(active):>6} {rows:>7} | {us:9.1f} "
                  f"{wbytes / (us * 1e-6) / 1e9:7.0f} | {tflops:8.1f}{extra}", flush=True)
            del g
        del w13, w2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
