#!/usr/bin/env python3
"""In-run peers of `moeforge bench --peers`: what users run today for an MoE layer on one GPU.

`moeforge bench` writes each token count's routing (the exact topk_ids and topk_weights its
own first timed input uses) into --routing-dir and runs this script with python3; the script
times, on the same GPU and the same routing, with random bf16 weights of the layer's shapes:

  torch         the PyTorch pipeline: argsort of the (token, k) pairs by expert, gather of
                their rows, torch._grouped_mm with W1 [E, H, 2F] (int32 cumulative offsets),
                the activation, torch._grouped_mm with W2 [E, F, H], the routing weight,
                index_add_ into y. If torch._grouped_mm is missing or disagrees with a
                per-expert torch.mm loop on the first token count, the loop is timed instead
                (the JSON says which).
  triton        a fused-MoE kernel pair in the style of vLLM's: the pairs sorted by expert
                and each expert's run padded to a multiple of BLOCK_M ("alignment", done
                here in torch without a host sync), one Triton GEMM over the padded runs
                with W1 (each row gathered from x), the activation in torch, a second Triton
                GEMM with W2 that multiplies by the routing weight, and the sum over k.
                Timed with the alignment in the call ("triton") and with it done once
                beforehand ("triton w/o align", what vLLM's CUDA alignment kernel comes
                close to). The block shape is the fastest of CONFIGS at each token count
                (both GEMMs share it), as vLLM's tuned configs would pick.

Activations: SwiGLU (silu(gate) * up, gate = the first F columns) or GPT-OSS's clamped
SwiGLU (gate clamped above at 7, up to +-7, gate * sigmoid(1.702 gate) * (up + 1)).
Shared experts (--shared-slices S) run as moeforge runs them: S more experts of FFN F
that every token hits with weight 1 (an MLP of FFN S*F is the sum of S MLPs of FFN F), in
the same grouped GEMMs. The peers run no expert biases and no router (moeforge's row
includes a spec's expert biases, so a comparison on such a layer favours the peers).

Timing: CUDA events around --calls back-to-back calls, per-call mean, median of 5 passes,
after 3 warm-up calls. This is not the method of moeforge's main column (events around
each call, a sync after each, median over calls): back-to-back calls hide Python's launch
costs behind the GPU's queue, so at small token counts the peers are timed in their
favour; moeforge's back-to-back column is timed this way too. Before timing, the
Triton pair's y is compared with the torch pipeline's at every token count and block
shape (relative max error over max |y|, reported as "agree"; the run fails above 2e-2: a
wrong kernel is not timed), and at the first token count the torch pipeline's
torch._grouped_mm with a per-expert torch.mm loop.

Output: JSON at --json: {"torch": version, "triton": version, "gemm_backend": ...,
"notes": [...], "rows": [{"tokens", "torch_us", "triton_us", "triton_no_align_us",
"triton_config", "agree"}]}. Exit status 0, 1 on a failed check, 77 when torch, triton or
a CUDA device is missing (the reason on stderr).
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

try:
    import torch
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - depends on the machine
    print(f"peers not run: {error}", file=sys.stderr)
    sys.exit(77)

PASSES = 5
WARMUP = 3
AGREE_LIMIT = 2e-2
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages): small blocks for few rows per
# expert, larger ones for many.
CONFIGS = [
    (16, 64, 128, 1, 4, 4),
    (32, 64, 64, 4, 4, 4),
    (64, 128, 64, 8, 4, 4),
    (128, 128, 64, 8, 8, 3),
]


@triton.jit
def fused_moe_gemm(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_pairs_ptr, block_expert_ptr, padded_pairs_ptr,
    N, K, padded_capacity, valid_pairs,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr,
):
    """C[pair] = A[pair // ROWS_PER_A] @ B[expert of the pair's block] (x routing weight)."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(padded_capacity, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_M >= tl.load(padded_pairs_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    valid = pairs < valid_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # expert * stride_be passes 2^31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs[:, None] // ROWS_PER_A).to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + ks[:, None] * stride_bk + (cols[None, :] % N) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & (ks[None, :] < left), other=0.0)
        b = tl.load(b_ptrs, mask=ks[:, None] < left, other=0.0)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if WEIGHTED:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def activation(name, h, ffn):
    gate, up = h[:, :ffn], h[:, ffn:]
    if name == "gpt_oss_swiglu":
        gate = gate.clamp(max=7.0)
        up = up.clamp(-7.0, 7.0)
        return (gate * torch.sigmoid(1.702 * gate) * (up + 1)).to(h.dtype)
    return (torch.nn.functional.silu(gate) * up).to(h.dtype)


class Layer:
    def __init__(self, args, device):
        g = torch.Generator(device=device).manual_seed(args.seed)
        # Routed experts, then the shared experts' slices.
        H, F, E = args.hidden, args.ffn, args.experts + args.shared_slices
        self.H, self.F, self.E, self.K = H, F, E, args.top_k + args.shared_slices
        self.routed_experts, self.routed_k = args.experts, args.top_k
        self.activation = args.activation
        # Uniform in +-sqrt(3 / fan_in), drawn in bf16 (no f32 copy of DeepSeek-V3's 22 GB).
        self.w1 = torch.empty(E, H, 2 * F, dtype=torch.bfloat16, device=device)
        self.w1.uniform_(-((3.0 / H) ** 0.5), (3.0 / H) ** 0.5, generator=g)
        self.w2 = torch.empty(E, F, H, dtype=torch.bfloat16, device=device)
        self.w2.uniform_(-((3.0 / F) ** 0.5), (3.0 / F) ** 0.5, generator=g)
        self.backend = "grouped_mm"


def expert_ffn_loop(layer, xs, counts_cpu):
    out, start = [], 0
    h_all = []
    for e, n in enumerate(counts_cpu):
        h_all.append(xs[start:start + n] @ layer.w1[e])
        start += n
    a = activation(layer.activation, torch.cat(h_all), layer.F)
    start = 0
    for e, n in enumerate(counts_cpu):
        out.append(a[start:start + n] @ layer.w2[e])
        start += n
    return torch.cat(out)


def torch_pipeline(layer, x, ids, weights):
    T = x.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // layer.K
    xs = x.index_select(0, tokens)
    if layer.backend == "grouped_mm":
        offs = torch.cumsum(torch.bincount(flat, minlength=layer.E), 0).to(torch.int32)
        h = torch._grouped_mm(xs, layer.w1, offs=offs)
        o = torch._grouped_mm(activation(layer.activation, h, layer.F), layer.w2, offs=offs)
    else:
        o = expert_ffn_loop(layer, xs, torch.bincount(flat, minlength=layer.E).tolist())
    o = o * weights.reshape(-1)[order].unsqueeze(1).to(o.dtype)
    return torch.zeros(T, layer.H, dtype=x.dtype, device=x.device).index_add_(0, tokens, o)


def align(ids, experts, block_m):
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m (padding
    holds the pair count), the expert of each block, and the padded total: no host sync."""
    flat = ids.reshape(-1)
    n = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    first = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    capacity = (n + experts * (block_m - 1) + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((capacity,), n, dtype=torch.int32, device=ids.device)
    rank = torch.arange(n, device=ids.device) - first[expert_of]
    sorted_pairs[starts[expert_of] + rank] = order.to(torch.int32)
    block_start = torch.arange(capacity // block_m, device=ids.device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).clamp_(max=experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def triton_gemm(a, b, c, weights, aligned, rows_per_a, weighted, config):
    sorted_pairs, block_expert, padded_pairs = aligned
    bm, bn, bk, group_m, warps, stages = config
    N, K = b.shape[2], b.shape[1]
    capacity = sorted_pairs.numel()
    grid = (triton.cdiv(capacity, bm) * triton.cdiv(N, bn),)
    fused_moe_gemm[grid](
        a, b, c, weights, sorted_pairs, block_expert, padded_pairs,
        N, K, capacity, weights.numel(),
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, ROWS_PER_A=rows_per_a,
        WEIGHTED=weighted, num_warps=warps, num_stages=stages,
    )


def triton_pair(layer, x, ids, weights, config, aligned=None):
    if aligned is None:
        aligned = align(ids, layer.E, config[0])
    T, pairs = x.shape[0], ids.numel()
    h = torch.empty(pairs, 2 * layer.F, dtype=x.dtype, device=x.device)
    triton_gemm(x, layer.w1, h, weights.reshape(-1), aligned, layer.K, False, config)
    a = activation(layer.activation, h, layer.F)
    o = torch.empty(pairs, layer.H, dtype=x.dtype, device=x.device)
    triton_gemm(a, layer.w2, o, weights.reshape(-1), aligned, 1, True, config)
    return o.view(T, layer.K, layer.H).sum(dim=1)


def time_calls(fn, calls):
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(PASSES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(per_call)


def relative_error(got, want):
    scale = want.float().abs().max().item()
    return (got.float() - want.float()).abs().max().item() / max(scale, 1e-30)


def read_routing(directory, tokens, layer, device):
    """The routed pairs of the files, then one pair per shared slice (weight 1) per token."""
    top_k = layer.routed_k
    ids = torch.frombuffer(bytearray((directory / f"topk_ids_{tokens}.i32").read_bytes()),
                           dtype=torch.int32)
    weights = torch.frombuffer(bytearray((directory / f"topk_weights_{tokens}.f32").read_bytes()),
                               dtype=torch.float32)
    if ids.numel() != tokens * top_k or weights.numel() != tokens * top_k:
        raise ValueError(f"routing files for {tokens} tokens do not hold {tokens} x {top_k} pairs")
    ids = ids.view(tokens, top_k).to(device).long()
    weights = weights.view(tokens, top_k).to(device)
    shared = layer.E - layer.routed_experts
    if shared:
        shared_ids = torch.arange(layer.routed_experts, layer.E, device=device).expand(tokens, shared)
        ids = torch.cat([ids, shared_ids], dim=1)
        weights = torch.cat([weights, torch.ones(tokens, shared, device=device)], dim=1)
    return ids, weights


def choose_backend(layer, x, ids, weights, notes):
    if not hasattr(torch, "_grouped_mm"):
        layer.backend = "mm_loop"
        notes.append("torch._grouped_mm is missing: the torch pipeline runs a per-expert torch.mm loop")
        return
    layer.backend = "mm_loop"
    want = torch_pipeline(layer, x, ids, weights)
    layer.backend = "grouped_mm"
    try:
        error = relative_error(torch_pipeline(layer, x, ids, weights), want)
    except RuntimeError as failure:
        error = None
        notes.append(f"torch._grouped_mm failed ({str(failure).splitlines()[0]}): the per-expert loop is timed")
    if error is not None and error > AGREE_LIMIT:
        notes.append(f"torch._grouped_mm disagreed with a per-expert loop ({error:.1e}): the loop is timed")
    if error is None or error > AGREE_LIMIT:
        layer.backend = "mm_loop"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--ffn", type=int, required=True)
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--shared-slices", type=int, default=0,
                        help="shared experts as always-hit experts of FFN --ffn each")
    parser.add_argument("--activation", choices=["swiglu", "gpt_oss_swiglu"], default="swiglu")
    parser.add_argument("--tokens", required=True, help="comma separated")
    parser.add_argument("--routing-dir", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("peers not run: torch sees no CUDA device", file=sys.stderr)
        sys.exit(77)
    device = torch.device("cuda")
    layer = Layer(args, device)
    token_counts = [int(t) for t in args.tokens.split(",") if t]
    notes, rows = [], []
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    backend_chosen = False
    for tokens in token_counts:
        row = {"tokens": tokens}
        if tokens == 0:
            rows.append(row)
            continue
        ids, weights = read_routing(args.routing_dir, tokens, layer, device)
        x = (torch.rand(tokens, layer.H, device=device, generator=generator) * 2 - 1).to(torch.bfloat16)
        if not backend_chosen:
            choose_backend(layer, x, ids, weights, notes)
            backend_chosen = True
        reference = torch_pipeline(layer, x, ids, weights)
        best = None
        for config in CONFIGS:
            y = triton_pair(layer, x, ids, weights, config)
            agree = relative_error(y, reference)
            if agree > AGREE_LIMIT:
                print(f"triton pair with {config} disagrees with the torch pipeline at {tokens} tokens: "
                      f"{agree:.2e} > {AGREE_LIMIT}", file=sys.stderr)
                sys.exit(1)
            us = time_calls(lambda: triton_pair(layer, x, ids, weights, config), max(args.calls // 4, 3))
            if best is None or us < best[0]:
                best = (us, config, agree)
        _, config, agree = best
        aligned = align(ids, layer.E, config[0])
        row.update(
            torch_us=time_calls(lambda: torch_pipeline(layer, x, ids, weights), args.calls),
            triton_us=time_calls(lambda: triton_pair(layer, x, ids, weights, config), args.calls),
            triton_no_align_us=time_calls(
                lambda: triton_pair(layer, x, ids, weights, config, aligned), args.calls),
            triton_config="BLOCK {}x{}x{}, group {}, {} warps, {} stages".format(*config),
            agree=agree,
        )
        print(f"peers at {tokens} tokens: torch {row['torch_us']:.1f} us, triton {row['triton_us']:.1f} us, "
              f"w/o align {row['triton_no_align_us']:.1f} us ({row['triton_config']})", file=sys.stderr)
        rows.append(row)
    args.json.write_text(json.dumps({
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gemm_backend": layer.backend,
        "notes": notes,
        "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
