#!/usr/bin/env python3
"""Baseline (c): an expert-parallel MoE layer written the way users write it today.

One process per GPU, NCCL backend, and for each forward call:

  1. route     every rank holds T tokens x [T, H] bf16, topk_ids [T, K] (distinct experts per
               token: uniform random, or with --routing skewed every token's first choice is
               expert 0) and topk_weights [T, K] f32 (softmax of random logits). Expert e lives
               on rank e // (E / R).
  2. dispatch  (token, k) pairs sorted by expert (hence by destination rank), per-expert counts
               exchanged with all_to_all_single, then the token rows with all_to_all_single.
               Mode "pairs" sends one row per (token, k) pair; mode "dedup" sends each token
               once per destination rank, with the list of its local experts and their weights.
  3. gemm      received rows grouped by local expert; torch._grouped_mm (bf16, int32 cumulative
               offsets) with W1 [E_local, H, 2F] -> SwiGLU (silu(gate) * up, gate = first F
               columns) -> torch._grouped_mm with W2 [E_local, F, H]. GPT-OSS-120B adds each
               expert's biases b1 [2F] and b2 [H] after each GEMM (gathered per row by its
               expert) and computes its clamped SwiGLU (gate clamped above at 7, up to +-7,
               gate * sigmoid(1.702 gate) * (up + 1)). Falls back to padding each
               expert's group to a multiple of 16 rows, then to a per-expert torch.mm loop, if
               torch._grouped_mm is missing, errors or disagrees; the output says which was used.
  4. combine   all_to_all_single back, scale by the routing weights, sum the K contributions of
               each token with index_add_ (mode "dedup": the expert rank first sums its local
               experts' weighted outputs per token, one row goes back per (token, rank)).

What is timed (CUDA events, per T tokens per rank): the whole layer, dispatch alone (source-side
sort/gather + counts exchange + host read of the split sizes + rows all-to-all), the GEMMs alone
(grouping by local expert + both grouped GEMMs + SwiGLU + un-grouping), and combine alone. Each
timed call follows a dist.barrier() so the ranks start together; every rank times its own call
and the per-call times are reduced with all_reduce(MAX); the reported figure is the median over
--iterations calls (after --warmup untimed calls of the layer). "cross-link GB/s" is the bytes a
rank sends to other ranks in one dispatch (mean over ranks) divided by the dispatch time.

Before timing, the EP result for --check-tokens tokens per rank is compared with a
single-process reference computed in fp32 on rank 0 from all_gather'ed inputs and weights;
pass if max |ep - ref| <= 2e-2 * max |ref| + 1e-3.

Output: a Markdown table on stdout (rank 0) and one JSON file per model,
<out>/<date>_ep_torch_<model>_R<r>.json. Exit status: 0 on success, 1 on a failed check or a
failed rank, 2 on a bad configuration (e.g. fewer than 2 GPUs).

Run (from the repository root, on a machine with >= 2 GPUs):

    python3 benches/ep_torch_baseline.py --model qwen3_30b_a3b --tokens 1,16,128,1024,4096
    python3 benches/ep_torch_baseline.py --model deepseek_v3 --ranks 2 --routing skewed
    python3 benches/ep_torch_baseline.py --model mixtral_8x7b,qwen3_30b_a3b,deepseek_v3 --out "$OUT"
    python3 benches/ep_torch_baseline.py --model gpt_oss_120b --tokens 1,128,4096

The script spawns its own processes (torch.multiprocessing, MASTER_ADDR=127.0.0.1 and a free
port); it also runs unchanged under torchrun (it then uses torchrun's RANK/WORLD_SIZE/...).
It never uses NVLink multicast (NVLS) or symmetric memory.
"""

import os

# Shared machine: never NVLink multicast / symmetric memory. Set before torch is imported;
# spawned processes inherit os.environ.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import List  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as tnf  # noqa: E402

MODELS = {
    "mixtral_8x7b": dict(H=4096, F=14336, E=8, K=2),
    "qwen3_30b_a3b": dict(H=2048, F=768, E=128, K=8),
    "deepseek_v3": dict(H=7168, F=2048, E=256, K=8),
    # Expert biases and the clamped SwiGLU (dsl-examples/gpt_oss_120b.moe).
    "gpt_oss_120b": dict(H=2880, F=2880, E=128, K=4, clamped=True, biases=True),
}
# GPT-OSS's clamped SwiGLU, as moeforge's `clamped_swiglu` computes it.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
BACKENDS = ["grouped_mm", "grouped_mm_pad16", "mm_loop"]  # in order of preference
DISPATCH_MODES = ["pairs", "dedup"]
BF16 = torch.bfloat16


def log0(*a):
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(*a, flush=True)


# --------------------------------------------------------------------------------------------
# Layer: this rank's experts
# --------------------------------------------------------------------------------------------


@dataclass
class Layer:
    name: str
    H: int
    F: int
    E: int
    K: int
    R: int
    rank: int
    E_local: int
    device: torch.device
    w1: torch.Tensor  # [E_local, H, 2F] bf16, columns [0, F) = gate, [F, 2F) = up
    w2: torch.Tensor  # [E_local, F, H] bf16
    b1: object = None  # [E_local, 2F] bf16 (gate, then up), or None: no expert biases
    b2: object = None  # [E_local, H] bf16, or None
    clamped: bool = False  # GPT-OSS's clamped SwiGLU rather than SwiGLU
    backend: str = "grouped_mm"
    backend_notes: List[str] = field(default_factory=list)


def build_layer(name, R, rank, device, seed):
    cfg = MODELS[name]
    H, F, E, K = cfg["H"], cfg["F"], cfg["E"], cfg["K"]
    E_local = E // R
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + rank)
    w1 = torch.randn((E_local, H, 2 * F), generator=g, device=device, dtype=BF16)
    w1.mul_(1.0 / math.sqrt(H))
    w2 = torch.randn((E_local, F, H), generator=g, device=device, dtype=BF16)
    w2.mul_(1.0 / math.sqrt(F))
    b1 = b2 = None
    if cfg.get("biases"):
        b1 = torch.randn((E_local, 2 * F), generator=g, device=device, dtype=BF16).mul_(0.1)
        b2 = torch.randn((E_local, H), generator=g, device=device, dtype=BF16).mul_(0.1)
    return Layer(name, H, F, E, K, R, rank, E_local, device, w1, w2, b1, b2,
                 clamped=cfg.get("clamped", False))


def make_inputs(layer, T, routing, seed):
    """x [T, H] bf16, topk_ids [T, K] int64 (distinct per token), topk_weights [T, K] f32."""
    dev, E, K = layer.device, layer.E, layer.K
    g = torch.Generator(device=dev)
    g.manual_seed(seed * 7919 + layer.rank * 104_729 + T)
    x = torch.randn((T, layer.H), generator=g, device=dev, dtype=BF16)
    if routing == "uniform":
        ids = torch.rand((T, E), generator=g, device=dev).argsort(dim=1)[:, :K]
    else:  # skewed: first choice expert 0, the other K-1 distinct among 1..E-1
        rest = torch.rand((T, E - 1), generator=g, device=dev).argsort(dim=1)[:, : K - 1] + 1
        ids = torch.cat([torch.zeros((T, 1), dtype=torch.int64, device=dev), rest], dim=1)
    ids = ids.to(torch.int64).contiguous()
    logits = torch.randn((T, K), generator=g, device=dev, dtype=torch.float32)
    w = torch.softmax(logits, dim=-1).contiguous()
    return x, ids, w


def expert_counts(flat_ids, n):
    """Histogram of flat_ids over [0, n) without a host sync (torch.bincount syncs on CUDA)."""
    counts = torch.zeros(n, dtype=torch.int64, device=flat_ids.device)
    return counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


# --------------------------------------------------------------------------------------------
# Expert FFN on rows already grouped by local expert
# --------------------------------------------------------------------------------------------


def activate(layer, h):
    """The experts' activation of GEMM1's output h [N, 2F] (gate columns, then up)."""
    gate, up = h[:, : layer.F], h[:, layer.F :]
    if not layer.clamped:
        return tnf.silu(gate) * up
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return gate * torch.sigmoid(SWIGLU_ALPHA * gate) * (up + 1)


def ffn_grouped(layer, xs, counts, counts_cpu, pad):
    """xs [N, H] grouped by local expert (counts [E_local] int64 on the GPU, same on the CPU)."""
    N, dev = xs.shape[0], xs.device
    # Each row's local expert, for its biases (and the padding's row map).
    e_of_row = None
    if pad or layer.b1 is not None:
        e_of_row = torch.repeat_interleave(
            torch.arange(layer.E_local, device=dev), counts, output_size=N
        )
    if not pad:
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = torch._grouped_mm(xs, layer.w1, offs=offs)
        if layer.b1 is not None:
            h = h + layer.b1[e_of_row]
        y = torch._grouped_mm(activate(layer, h), layer.w2, offs=offs)
        return y if layer.b2 is None else y + layer.b2[e_of_row]
    # Pad every expert's group to a multiple of 16 rows (zero rows), computed on the GPU.
    padded = (counts + 15) // 16 * 16
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    start = torch.cumsum(counts, 0) - counts
    dst = pstart[e_of_row] + torch.arange(N, device=dev) - start[e_of_row]
    cap = sum((c + 15) // 16 * 16 for c in counts_cpu)
    xp = xs.new_zeros((cap, layer.H))
    xp.index_copy_(0, dst, xs)
    offs = pend.to(torch.int32)
    h = torch._grouped_mm(xp, layer.w1, offs=offs)
    if layer.b1 is not None:  # the padding's rows take none: their outputs are dropped
        h.index_add_(0, dst, layer.b1[e_of_row])
    y = torch._grouped_mm(activate(layer, h), layer.w2, offs=offs).index_select(0, dst)
    return y if layer.b2 is None else y + layer.b2[e_of_row]


def ffn_mm_loop(layer, xs, counts_cpu):
    out = xs.new_empty((xs.shape[0], layer.H))
    s = 0
    for j, c in enumerate(counts_cpu):
        if c:
            h = torch.mm(xs[s : s + c], layer.w1[j])
            if layer.b1 is not None:
                h = h + layer.b1[j]
            y = torch.mm(activate(layer, h), layer.w2[j])
            out[s : s + c] = y if layer.b2 is None else y + layer.b2[j]
        s += c
    return out


def expert_ffn(layer, xs, counts, counts_cpu):
    if xs.shape[0] == 0:
        return xs.new_empty((0, layer.H))
    while True:
        try:
            if layer.backend == "grouped_mm":
                return ffn_grouped(layer, xs, counts, counts_cpu, pad=False)
            if layer.backend == "grouped_mm_pad16":
                return ffn_grouped(layer, xs, counts, counts_cpu, pad=True)
            return ffn_mm_loop(layer, xs, counts_cpu)
        except RuntimeError as e:  # argument checks of _grouped_mm; local, no collective inside
            if layer.backend == "mm_loop":
                raise
            nxt = BACKENDS[BACKENDS.index(layer.backend) + 1]
            msg = f"rank {layer.rank}: {layer.backend} failed at N={xs.shape[0]} ({first_line(e)}); using {nxt}"
            print(f"WARNING: {msg}", flush=True)
            layer.backend_notes.append(msg)
            layer.backend = nxt


def first_line(e):
    s = str(e).strip().splitlines()
    return s[0][:200] if s else type(e).__name__


def close_enough(out, ref):
    out, ref = out.float(), ref.float()
    err = (out - ref).abs().max().item()
    bound = 2e-2 * ref.abs().max().item() + 1e-3
    return bool(math.isfinite(err) and err <= bound), err, bound


def choose_gemm_backend(layer):
    """Probe torch._grouped_mm on unaligned groups (incl. an empty one) against a torch.mm loop;
    every rank then adopts the most conservative choice of any rank."""
    notes = []
    choice = 2
    if not hasattr(torch, "_grouped_mm"):
        notes.append("torch._grouped_mm is not available in this torch build")
    else:
        pattern = [5, 0, 17, 3, 33, 1, 8, 21]
        counts_cpu = [pattern[j % len(pattern)] for j in range(layer.E_local)]
        if layer.E_local == 1:
            counts_cpu = [5]
        N = sum(counts_cpu)
        g = torch.Generator(device=layer.device)
        g.manual_seed(12345 + layer.rank)
        xs = torch.randn((N, layer.H), generator=g, device=layer.device, dtype=BF16)
        counts = torch.tensor(counts_cpu, dtype=torch.int64, device=layer.device)
        ref = ffn_mm_loop(layer, xs, counts_cpu)
        for i, pad in ((0, False), (1, True)):
            try:
                out = ffn_grouped(layer, xs, counts, counts_cpu, pad=pad)
                torch.cuda.synchronize(layer.device)
                ok, err, bound = close_enough(out, ref)
                if ok:
                    choice = i
                    break
                notes.append(f"{BACKENDS[i]} disagrees with torch.mm (max err {err:.3g} > {bound:.3g})")
            except Exception as e:  # noqa: BLE001
                notes.append(f"{BACKENDS[i]} errored: {first_line(e)}")
        del xs, ref
    t = torch.tensor([choice], dtype=torch.int64, device=layer.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    layer.backend = BACKENDS[int(t.item())]
    if layer.backend == "grouped_mm_pad16":
        notes.append("each expert's group is padded to a multiple of 16 rows for torch._grouped_mm")
    layer.backend_notes = notes
    return layer.backend


# --------------------------------------------------------------------------------------------
# Mode "pairs": one row per (token, k) pair
# --------------------------------------------------------------------------------------------


@dataclass
class PairDispatch:
    T: int
    pair_order: torch.Tensor  # [T*K] pair index (t*K + k), sorted by expert id
    token_of_pair: torch.Tensor  # [T*K]
    topk_w: torch.Tensor  # [T, K] f32
    send_splits: List[int]  # rows to each rank
    recv_splits: List[int]  # rows from each rank
    recv_x: torch.Tensor  # [N, H]: chunk per source rank, inside it sorted by local expert
    recv_counts: torch.Tensor  # [R * E_local]: rows from (source rank r, local expert j)
    counts_local: torch.Tensor  # [E_local] GPU
    counts_local_cpu: List[int]
    bytes_off_rank: int
    rows_in: int
    pairs_in: int


def dispatch_pairs(layer, x, ids, w):
    T, K, E, R, El = ids.shape[0], layer.K, layer.E, layer.R, layer.E_local
    flat = ids.reshape(-1)  # pair p = t*K + k
    pair_order = torch.argsort(flat, stable=True)  # by expert, hence by destination rank
    token_of_pair = pair_order // K
    send_x = x.index_select(0, token_of_pair)  # [T*K, H]
    send_counts = expert_counts(flat, E)  # [E]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)  # equal splits: E_local per rank
    meta = torch.cat([send_counts, recv_counts]).tolist()  # the one host sync
    send_e, recv_e = meta[:E], meta[E:]
    send_splits = [sum(send_e[r * El : (r + 1) * El]) for r in range(R)]
    recv_splits = [sum(recv_e[r * El : (r + 1) * El]) for r in range(R)]
    counts_local_cpu = [sum(recv_e[r * El + j] for r in range(R)) for j in range(El)]
    N = sum(recv_splits)
    recv_x = x.new_empty((N, layer.H))
    dist.all_to_all_single(
        recv_x, send_x, output_split_sizes=recv_splits, input_split_sizes=send_splits
    )
    off = sum(s for r, s in enumerate(send_splits) if r != layer.rank)
    return PairDispatch(
        T=T,
        pair_order=pair_order,
        token_of_pair=token_of_pair,
        topk_w=w,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_x=recv_x,
        recv_counts=recv_counts,
        counts_local=recv_counts.view(R, El).sum(0),
        counts_local_cpu=counts_local_cpu,
        bytes_off_rank=off * layer.H * 2,
        rows_in=N,
        pairs_in=N,
    )


def gemm_pairs(layer, st):
    """Returns y [N, H] in the received row order."""
    N, dev = st.recv_x.shape[0], layer.device
    if N == 0:
        return st.recv_x.new_empty((0, layer.H))
    local_e = torch.repeat_interleave(
        torch.arange(layer.E_local, device=dev).repeat(layer.R), st.recv_counts, output_size=N
    )
    order = torch.argsort(local_e, stable=True)
    xs = st.recv_x.index_select(0, order)
    ys = expert_ffn(layer, xs, st.counts_local, st.counts_local_cpu)
    return torch.empty_like(ys).index_copy_(0, order, ys)


def combine_pairs(layer, st, y):
    back = y.new_empty((st.T * layer.K, layer.H))
    dist.all_to_all_single(
        back, y.contiguous(), output_split_sizes=st.send_splits, input_split_sizes=st.recv_splits
    )
    w_sorted = st.topk_w.reshape(-1).index_select(0, st.pair_order)
    out = torch.zeros((st.T, layer.H), dtype=torch.float32, device=layer.device)
    out.index_add_(0, st.token_of_pair, back.float() * w_sorted.unsqueeze(1))
    return out.to(BF16)


# --------------------------------------------------------------------------------------------
# Mode "dedup": one row per (token, destination rank) + its local expert ids and weights
# --------------------------------------------------------------------------------------------


@dataclass
class DedupDispatch:
    T: int
    tok: torch.Tensor  # [n] token of each sent row (rows sorted by destination rank, then token)
    send_splits: List[int]
    recv_splits: List[int]
    recv_x: torch.Tensor  # [m, H]
    recv_meta: torch.Tensor  # [m, 2K] int32: K local expert ids (-1 = not here), K f32 weights (bits)
    counts_local: torch.Tensor  # [E_local] GPU, pairs per local expert
    counts_local_cpu: List[int]
    bytes_off_rank: int
    rows_in: int
    pairs_in: int


@dataclass
class DedupGemm:
    ys: torch.Tensor  # [P, H] expert outputs, grouped by local expert
    row_of_pair: torch.Tensor  # [P] received row of each pair
    w_pair: torch.Tensor  # [P] f32 routing weight


def dispatch_dedup(layer, x, ids, w):
    T, K, E, R, El = ids.shape[0], layer.K, layer.E, layer.R, layer.E_local
    dev = layer.device
    dest = ids // El  # [T, K] destination rank of each pair
    mask = torch.zeros((T, R), dtype=torch.bool, device=dev)
    mask.scatter_(1, dest, True)  # token t goes to rank r
    tok_counts = mask.sum(0)  # [R]
    pair_counts = expert_counts(ids.reshape(-1), E)  # [E]
    send_packed = torch.cat([tok_counts.view(R, 1), pair_counts.view(R, El)], dim=1).contiguous()
    recv_packed = torch.empty_like(send_packed)  # [R, 1 + E_local]
    dist.all_to_all_single(recv_packed, send_packed)  # equal splits: one row per rank
    meta = torch.cat([send_packed.reshape(-1), recv_packed.reshape(-1)]).tolist()  # host sync
    W = 1 + El
    sendm, recvm = meta[: R * W], meta[R * W :]
    send_splits = [sendm[r * W] for r in range(R)]
    recv_splits = [recvm[r * W] for r in range(R)]
    counts_local_cpu = [sum(recvm[r * W + 1 + j] for r in range(R)) for j in range(El)]
    n, m = sum(send_splits), sum(recv_splits)
    # Selected (rank, token) slots in rank-major order, without another host sync.
    flat = mask.t().reshape(-1)  # [R*T], index r*T + t
    sel = torch.argsort((~flat).to(torch.int32), stable=True)[:n]
    dest_r = sel // T
    tok = sel - dest_r * T
    ids_t = ids.index_select(0, tok)  # [n, K]
    on_r = (ids_t // El) == dest_r.unsqueeze(1)
    meta_ids = torch.where(on_r, ids_t - dest_r.unsqueeze(1) * El, -1).to(torch.int32)
    meta_w = torch.where(on_r, w.index_select(0, tok), 0.0).to(torch.float32).contiguous()
    send_meta = torch.cat([meta_ids, meta_w.view(torch.int32)], dim=1).contiguous()  # [n, 2K]
    send_x = x.index_select(0, tok)  # [n, H]
    recv_meta = torch.empty((m, 2 * K), dtype=torch.int32, device=dev)
    recv_x = x.new_empty((m, layer.H))
    dist.all_to_all_single(
        recv_meta, send_meta, output_split_sizes=recv_splits, input_split_sizes=send_splits
    )
    dist.all_to_all_single(
        recv_x, send_x, output_split_sizes=recv_splits, input_split_sizes=send_splits
    )
    off = sum(s for r, s in enumerate(send_splits) if r != layer.rank)
    return DedupDispatch(
        T=T,
        tok=tok,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_x=recv_x,
        recv_meta=recv_meta,
        counts_local=recv_packed[:, 1:].sum(0),
        counts_local_cpu=counts_local_cpu,
        bytes_off_rank=off * (layer.H * 2 + 2 * K * 4),
        rows_in=m,
        pairs_in=sum(counts_local_cpu),
    )


def gemm_dedup(layer, st):
    K, El = layer.K, layer.E_local
    P = st.pairs_in
    local_ids = st.recv_meta[:, :K].reshape(-1)  # [m*K]
    local_w = st.recv_meta[:, K:].contiguous().view(torch.float32).reshape(-1)  # [m*K]
    key = torch.where(local_ids >= 0, local_ids, El)  # absent slots sort last
    order = torch.argsort(key, stable=True)[:P]  # pairs grouped by local expert
    row_of_pair = order // K
    w_pair = local_w.index_select(0, order)
    xs = st.recv_x.index_select(0, row_of_pair)
    ys = expert_ffn(layer, xs, st.counts_local, st.counts_local_cpu)
    return DedupGemm(ys=ys, row_of_pair=row_of_pair, w_pair=w_pair)


def combine_dedup(layer, st, g):
    m = st.recv_x.shape[0]
    partial = torch.zeros((m, layer.H), dtype=torch.float32, device=layer.device)
    partial.index_add_(0, g.row_of_pair, g.ys.float() * g.w_pair.unsqueeze(1))
    partial = partial.to(BF16)
    back = partial.new_empty((st.tok.shape[0], layer.H))
    dist.all_to_all_single(
        back, partial, output_split_sizes=st.send_splits, input_split_sizes=st.recv_splits
    )
    out = torch.zeros((st.T, layer.H), dtype=torch.float32, device=layer.device)
    out.index_add_(0, st.tok, back.float())
    return out.to(BF16)


PHASES = {
    "pairs": (dispatch_pairs, gemm_pairs, combine_pairs),
    "dedup": (dispatch_dedup, gemm_dedup, combine_dedup),
}


def run_layer(layer, mode, x, ids, w):
    dispatch, gemm, combine = PHASES[mode]
    st = dispatch(layer, x, ids, w)
    return combine(layer, st, gemm(layer, st))


# --------------------------------------------------------------------------------------------
# Correctness: EP result vs. a single-process fp32 reference on rank 0
# --------------------------------------------------------------------------------------------


def gather_rows(t):
    t = t.contiguous()
    out = t.new_empty((dist.get_world_size() * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t)
    return out


def check_correctness(layer, modes, T, routing, seed):
    x, ids, w = make_inputs(layer, T, routing, seed + 1)
    ep = {mode: run_layer(layer, mode, x, ids, w) for mode in modes}
    xg, idg, wg = gather_rows(x), gather_rows(ids), gather_rows(w)
    epg = {mode: gather_rows(ep[mode]) for mode in modes}
    R, El, F, H = layer.R, layer.E_local, layer.F, layer.H
    is0 = layer.rank == 0
    ref = torch.zeros((R * T, H), dtype=torch.float32, device=layer.device) if is0 else None
    # Weights are gathered one local-expert slot at a time: slot j of rank r is expert r*El + j.
    biased = layer.b1 is not None
    for j in range(El):
        w1g = layer.w1.new_empty((R * H, 2 * F))  # concatenation along dim 0
        w2g = layer.w2.new_empty((R * F, H))
        dist.all_gather_into_tensor(w1g, layer.w1[j].contiguous())
        dist.all_gather_into_tensor(w2g, layer.w2[j].contiguous())
        w1g, w2g = w1g.view(R, H, 2 * F), w2g.view(R, F, H)
        if biased:
            b1g = layer.b1.new_empty((R, 2 * F))
            b2g = layer.b2.new_empty((R, H))
            dist.all_gather_into_tensor(b1g, layer.b1[j].contiguous())
            dist.all_gather_into_tensor(b2g, layer.b2[j].contiguous())
        if is0:
            for r in range(R):
                tok, kk = (idg == r * El + j).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue
                h = xg.index_select(0, tok).float() @ w1g[r].float()
                if biased:
                    h = h + b1g[r].float()
                y = activate(layer, h) @ w2g[r].float()
                if biased:
                    y = y + b2g[r].float()
                ref.index_add_(0, tok, y * wg[tok, kk].unsqueeze(1))
        del w1g, w2g
    results = {}
    ok_all = True
    if is0:
        for mode in modes:
            ok, err, bound = close_enough(epg[mode], ref)
            results[mode] = dict(tokens_per_rank=T, max_abs_err=err, bound=bound, passed=ok,
                                 max_abs_ref=ref.abs().max().item())
            ok_all = ok_all and ok
    flag = torch.tensor([1 if ok_all else 0], dtype=torch.int64, device=layer.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item()), results


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_calls(layer, fn, iters):
    """Median over iters of (max over ranks of the CUDA-event time of one call), in us."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(iters):
        dist.barrier(device_ids=[layer.device.index])
        start.record()
        fn()
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    t = torch.tensor(ms, dtype=torch.float64, device=layer.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist()) * 1000.0


def bench_case(layer, mode, T, args):
    dispatch, gemm, combine = PHASES[mode]
    x, ids, w = make_inputs(layer, T, args.routing, args.seed)
    for _ in range(args.warmup):
        run_layer(layer, mode, x, ids, w)
    torch.cuda.synchronize(layer.device)
    layer_us = time_calls(layer, lambda: run_layer(layer, mode, x, ids, w), args.iterations)
    dispatch_us = time_calls(layer, lambda: dispatch(layer, x, ids, w), args.iterations)
    st = dispatch(layer, x, ids, w)
    gemm_us = time_calls(layer, lambda: gemm(layer, st), args.iterations)
    g = gemm(layer, st)
    combine_us = time_calls(layer, lambda: combine(layer, st, g), args.iterations)
    s = torch.tensor([float(st.bytes_off_rank)], dtype=torch.float64, device=layer.device)
    dist.all_reduce(s, op=dist.ReduceOp.SUM)
    mx = torch.tensor([st.rows_in, st.pairs_in], dtype=torch.int64, device=layer.device)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX)
    bytes_mean = s.item() / layer.R
    rows_max, pairs_max = (int(v) for v in mx.tolist())
    del st, g, x, ids, w
    return dict(
        dispatch=mode,
        tokens=T,
        layer_us=layer_us,
        dispatch_us=dispatch_us,
        gemm_us=gemm_us,
        combine_us=combine_us,
        dispatch_bytes_off_rank=bytes_mean,
        cross_link_gbps=(bytes_mean / (dispatch_us * 1e3)) if dispatch_us > 0 else 0.0,
        max_rows_received=rows_max,
        max_pairs_received=pairs_max,
        iterations=args.iterations,
    )


def markdown_table(model, R, rows):
    lines = [
        "| model | R | dispatch | T per rank | layer us | dispatch us | gemm us | combine us | cross-link GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {model} | {R} | {r['dispatch']} | {r['tokens']} | {r['layer_us']:.1f} | "
            f"{r['dispatch_us']:.1f} | {r['gemm_us']:.1f} | {r['combine_us']:.1f} | "
            f"{r['cross_link_gbps']:.1f} |"
        )
    return "\n".join(lines)


def nccl_version_str():
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({first_line(e)})"
    if isinstance(v, (tuple, list)):
        return ".".join(str(p) for p in v)
    return str(v)


# --------------------------------------------------------------------------------------------
# Per-process driver
# --------------------------------------------------------------------------------------------


def worker(local_rank, args):
    if args.spawned:
        os.environ["RANK"] = str(local_rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.set_float32_matmul_precision("highest")  # fp32 reference without TF32
    dist.init_process_group(
        backend="nccl",
        init_method="env://",
        rank=rank,
        world_size=world,
        device_id=device,
        timeout=datetime.timedelta(seconds=args.timeout_s),
    )
    failures = []
    date = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name(device)
    modes = DISPATCH_MODES if args.dispatch == "both" else [args.dispatch]
    log0(f"# EP MoE baseline (torch + NCCL all_to_all_single), R={world}, GPU {gpu}, "
         f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl_version_str()}, "
         f"routing {args.routing}")
    for model in args.models:
        layer = build_layer(model, world, rank, device, args.seed)
        backend = choose_gemm_backend(layer)
        log0(f"\n## {model}: H={layer.H} F={layer.F} E={layer.E} K={layer.K}, "
             f"{layer.E_local} experts per rank; GEMM backend: {backend}")
        for note in layer.backend_notes:
            log0(f"   note: {note}")

        check = None
        if args.check_tokens > 0:
            ok, check = check_correctness(layer, modes, args.check_tokens, args.routing, args.seed)
            for mode, c in check.items():
                log0(f"   check ({mode}, T={c['tokens_per_rank']} per rank): max abs err "
                     f"{c['max_abs_err']:.3e} vs bound {c['bound']:.3e} "
                     f"(max|ref| {c['max_abs_ref']:.3e}): {'PASS' if c['passed'] else 'FAIL'}")
            if not ok:
                failures.append(f"{model}: EP result disagrees with the single-process reference")
                log0(f"   CORRECTNESS CHECK FAILED for {model}")

        rows = []
        for T in args.tokens:
            for mode in modes:
                rows.append(bench_case(layer, mode, T, args))

        # The backend may have been downgraded at run time on some rank: report the worst.
        t = torch.tensor([BACKENDS.index(layer.backend)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        backend = BACKENDS[int(t.item())]

        if rank == 0:
            print()
            print(markdown_table(model, world, rows), flush=True)
            result = dict(
                benchmark="ep_torch_baseline",
                layer=model,
                date=date,
                gpu=gpu,
                torch=torch.__version__,
                cuda=torch.version.cuda,
                nccl=nccl_version_str(),
                ranks=world,
                routing=args.routing,
                H=layer.H,
                F=layer.F,
                E=layer.E,
                K=layer.K,
                experts_per_rank=layer.E_local,
                gemm_backend=backend,
                gemm_backend_notes=layer.backend_notes,
                warmup=args.warmup,
                iterations=args.iterations,
                timing=("CUDA events per call after dist.barrier(); per call max over ranks "
                        "(all_reduce MAX); median over iterations"),
                cross_link_gbps_definition=("mean over ranks of bytes one rank sends to other "
                                            "ranks in one dispatch / dispatch time"),
                check=check,
                check_passed=(check is not None and all(c["passed"] for c in check.values())),
                rows=rows,
            )
            out_dir = Path(args.out)
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{date}_ep_torch_{model}_R{world}.json"
            path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {path}", flush=True)

        del layer
        torch.cuda.empty_cache()
        dist.barrier(device_ids=[local_rank])

    if failures and rank == 0:
        for f in failures:
            print(f"FAILED: {f}", file=sys.stderr, flush=True)
    dist.barrier(device_ids=[local_rank])  # let rank 0 finish printing before any rank exits
    dist.destroy_process_group()
    return 1 if failures else 0


def spawned_worker(local_rank, args):
    status = worker(local_rank, args)
    if status:
        sys.exit(status)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3_30b_a3b",
                   help=f"comma-separated list of {', '.join(MODELS)} (default: qwen3_30b_a3b)")
    p.add_argument("--tokens", default="1,16,128,1024,4096", help="tokens per rank, comma-separated")
    p.add_argument("--ranks", type=int, default=0, help="number of GPUs/processes (default: all visible)")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform")
    p.add_argument("--dispatch", choices=["pairs", "dedup", "both"], default="both",
                   help="pairs: one row per (token, k); dedup: one row per (token, rank); both (default)")
    p.add_argument("--dedup", action="store_true", help="shorthand for --dispatch dedup")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--check-tokens", type=int, default=16,
                   help="tokens per rank for the correctness check (0 disables it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=int, default=300, help="NCCL collective timeout")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                   help="directory for the JSON results (default: benches/results/)")
    args = p.parse_args(argv)
    if args.dedup:
        args.dispatch = "dedup"
    args.models = [m.strip() for m in args.model.split(",") if m.strip()]
    try:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    return args


def config_error(msg):
    print(f"ep_torch_baseline: {msg}", file=sys.stderr, flush=True)
    return 2


def main(argv=None):
    args = parse_args(argv)
    for m in args.models:
        if m not in MODELS:
            return config_error(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    if not args.tokens or any(t < 1 for t in args.tokens):
        return config_error("--tokens needs positive integers")
    if args.iterations < 1 or args.warmup < 0 or args.check_tokens < 0:
        return config_error("--iterations must be >= 1, --warmup and --check-tokens >= 0")
    if not torch.cuda.is_available():
        return config_error("CUDA is not available; this benchmark needs >= 2 NVIDIA GPUs")
    if not dist.is_available() or not dist.is_nccl_available():
        return config_error("torch.distributed with NCCL is not available in this torch build")
    n_gpus = torch.cuda.device_count()

    under_launcher = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                    "MASTER_ADDR", "MASTER_PORT"))
    R = int(os.environ["WORLD_SIZE"]) if under_launcher else (args.ranks or n_gpus)
    if R < 2 or n_gpus < 2:
        return config_error(f"expert parallelism needs at least 2 GPUs/ranks; "
                            f"{n_gpus} visible GPU(s), {R} rank(s) requested")
    if not under_launcher and R > n_gpus:
        return config_error(f"--ranks {R} but only {n_gpus} GPU(s) are visible")
    for m in args.models:
        if MODELS[m]["E"] % R:
            return config_error(f"{m} has E={MODELS[m]['E']} experts, not divisible by R={R}")

    if under_launcher:
        args.spawned = False
        return worker(int(os.environ["LOCAL_RANK"]), args)

    args.spawned = True
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["WORLD_SIZE"] = str(R)
    try:
        mp.spawn(spawned_worker, args=(args,), nprocs=R, join=True)
    except Exception as e:  # noqa: BLE001  (ProcessRaisedException / ProcessExitedException)
        print(f"ep_torch_baseline: FAILED (correctness check or an error on a rank, see above): "
              f"{first_line(e)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
