# Inserts %globaltimer probes into the fused router of compiler/templates/router.cu: each
# block's entry and the end of its wait and gate (atomics on module globals), then the
# selecting block's hand-off, sum, select and routing metadata, and token 0's select
# phases; the last block prints them (`PROBE router ...`, `PROBE select ...`) and resets
# the globals. A measurement build only, never committed: the printf and the atomics add
# to the kernel (sub-microsecond phases; the select's inner stamps are fuzzy, as the
# compiler moves non-volatile work across them).
# Usage, in a scratch worktree: python3 insert_probes.py compiler/templates/router.cu, build
# moeforge there, then on the GPU `moeforge bench M.moe --tokens T --iterations 3 | grep PROBE`.
import sys
p=sys.argv[1]
s=open(p).read()
probe='''__device__ unsigned long long g_probe_first_entry = ~0ull;
__device__ unsigned long long g_probe_last_entry = 0ull;
__device__ unsigned long long g_probe_last_gate_end = 0ull;
__device__ unsigned long long g_probe_last_waited = 0ull;
__device__ unsigned long long g_probe_select[8];
__device__ __forceinline__ unsigned long long probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
'''
anchor='template <class G, class Store>\n__device__ __forceinline__ void router_gate('
assert anchor in s; s=s.replace(anchor, probe+anchor,1)
def rep(old,new):
    global s
    assert old in s, old
    s=s.replace(old,new,1)
rep('''    const int token_tiles = (tokens + G::BM - 1) / G::BM;
    const GateBlock b = gate_block<G>(tokens);''','''    const unsigned long long probe_entry = probe_now();
    if (threadIdx.x == 0) { atomicMin(&g_probe_first_entry, probe_entry); atomicMax(&g_probe_last_entry, probe_entry); }
    const int token_tiles = (tokens + G::BM - 1) / G::BM;
    const GateBlock b = gate_block<G>(tokens);''')
rep('''    router_gate<G>(x, gate_weight, tokens, b, LogitsStore{router_logits + b.split * slice});
''','''    router_gate<G>(x, gate_weight, tokens, b, LogitsStore{router_logits + b.split * slice});
    if (threadIdx.x == 0) atomicMax(&g_probe_last_gate_end, probe_now());
''')
rep('''    if (!last_arrival(&router_tiles_done[1 + token_tile], G::EXPERT_TILES * b.splits)) return;
''','''    if (!last_arrival(&router_tiles_done[1 + token_tile], G::EXPERT_TILES * b.splits)) return;
    const unsigned long long probe_selecting = probe_now();
''')
rep('''    // Select: this token tile's tokens, a warp each''','''    const unsigned long long probe_summed = probe_now();
    // Select: this token tile's tokens, a warp each''')
old='''        if constexpr (G::NEXT_STARTS_EARLY) {
            start_after_previous_kernel();
        } else {
            wait_for_previous_kernel();
        }
'''
rep(old, old+'''        if (threadIdx.x == 0) atomicMax(&g_probe_last_waited, probe_now());
''')
rep('''    // Routing metadata over every token's choices, unless something else routes the call:
    // the fused decode, the GEMMs' blocks or the expert-parallel kernels.
    if (!lays_out_routing) return;
    int* s_count = reinterpret_cast<int*>(smem);
    route_pairs<G::THREADS>(routed_ids, tokens, expert_offsets, row_pair, error_word, s_count, s_count + GEMM_EXPERTS);
}''','''    const unsigned long long probe_selected = probe_now();
    if (lays_out_routing) {
        int* s_count = reinterpret_cast<int*>(smem);
        route_pairs<G::THREADS>(routed_ids, tokens, expert_offsets, row_pair, error_word, s_count, s_count + GEMM_EXPERTS);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned long long done = probe_now();
        const unsigned long long first = g_probe_first_entry;
        printf("PROBE router T=%d splits=%d: waited +%.2f, gate end +%.2f, handoff %.2f, sum %.2f, select %.2f, metadata(%d) %.2f, total %.2f us\\n",
               tokens, b.splits, (g_probe_last_waited ? (g_probe_last_waited - first) * 1e-3 : -1.0), (g_probe_last_gate_end - first) * 1e-3,
               (probe_selecting - g_probe_last_gate_end) * 1e-3, (probe_summed - probe_selecting) * 1e-3, (probe_selected - probe_summed) * 1e-3,
               lays_out_routing, (done - probe_selected) * 1e-3, (done - first) * 1e-3);
        printf("PROBE select T=%d token 0: scores %.2f, group %.2f, top-k %.2f, weights %.2f us\\n", tokens,
               (g_probe_select[1] - g_probe_select[0]) * 1e-3, (g_probe_select[2] - g_probe_select[1]) * 1e-3,
               (g_probe_select[3] - g_probe_select[2]) * 1e-3, (g_probe_select[4] - g_probe_select[3]) * 1e-3);
        g_probe_first_entry = ~0ull;
        g_probe_last_entry = 0ull;
        g_probe_last_gate_end = 0ull;
        g_probe_last_waited = 0ull;
    }
}''')
TOKEN0 = 'token[0]' if 'const int (&token)[N]' in s else 'token'
def stamp(i): return f'    if ({TOKEN0} == 0 && lane == 0) g_probe_select[{i}] = probe_now();\n'
rep('''    const int lane = threadIdx.x & 31;

    // Phase 1: logits''','''    const int lane = threadIdx.x & 31;
'''+stamp(0)+'''
    // Phase 1: logits''')
rep('''    // Phase 4: group limit.''', stamp(1)+'''    // Phase 4: group limit.''')
rep('''    // Phase 5: top-k by selection value, best first.''', stamp(2)+'''    // Phase 5: top-k by selection value, best first.''')
rep('''    // Phase 6: weights:''', stamp(3)+'''    // Phase 6: weights:''')
if TOKEN0 == 'token':
    rep('''            routed_weights[(size_t)token * TOP_K + k] = weight[j] * ROUTER_SCALE;
        }
    }
}''','''            routed_weights[(size_t)token * TOP_K + k] = weight[j] * ROUTER_SCALE;
        }
    }
'''+stamp(4)+'}')
else:
    rep('''                routed_weights[(size_t)token[n] * TOP_K + k] = weight[n][j] * ROUTER_SCALE;
            }
        }
    }
}''','''                routed_weights[(size_t)token[n] * TOP_K + k] = weight[n][j] * ROUTER_SCALE;
            }
        }
    }
'''+stamp(4)+'}')
open(p,'w').write(s)
