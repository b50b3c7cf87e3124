//! Property test: for generated valid layers written in random layouts (spacing, line
//! breaks of every convention, comments, entry order, equivalent units), `fmt` keeps the meaning (the checked
//! `ir::Module` is the same) and is idempotent.

use proptest::prelude::*;

use moeforge_compiler::{compile_source, format_source};

/// One generated file: a topology and a layer, as lists of entries to lay out.
#[derive(Debug, Clone)]
struct Spec {
    topology: Vec<String>,
    layer: Vec<String>,
}

fn link() -> impl Strategy<Value = String> {
    let bandwidth = prop_oneof![
        (1u64..1000).prop_map(|n| format!("{n} GB/s")),
        (1u64..1_000_000).prop_map(|n| format!("{n} MB/s")),
        (1u64..100).prop_map(|n| format!("{n}.5 TB/s")),
        (1u64..1000).prop_map(|n| format!("{n} GiB/s")),
    ];
    let latency = prop_oneof![
        (0u64..100).prop_map(|n| format!("{n} us")),
        (0u64..100_000).prop_map(|n| format!("{n} ns")),
        (1u64..10).prop_map(|n| format!("{n}.25 ms")),
    ];
    (bandwidth, latency, any::<bool>()).prop_map(|(b, l, swap)| {
        if swap {
            format!("{l}, {b}")
        } else {
            format!("{b}, {l}")
        }
    })
}

fn spec() -> impl Strategy<Value = Spec> {
    let ranks = prop_oneof![Just(1u32), Just(2), Just(4), Just(8)];
    (ranks, 1u32..=32, any::<bool>(), link(), link())
        .prop_flat_map(|(ranks, experts_per_rank, virtual_ranks, intra, network)| {
            let experts = ranks * experts_per_rank;
            let group_counts: Vec<u32> = (1..=experts).filter(|g| experts % g == 0).collect();
            (
                Just((ranks, experts, virtual_ranks, intra, network)),
                1u32..=128,
                1u32..=256,
                1u32..=experts.min(16),
                prop::sample::select(vec!["swiglu", "geglu", "gelu", "relu", "silu"]),
                prop::option::of(1u32..=65_536),
                prop::option::of((1u32..=2, 1u32..=4, any::<bool>())),
                prop::option::of((prop::sample::select(group_counts), 0u32..3, 1u32..=40)),
                prop::collection::vec(any::<u8>(), 6),
            )
        })
        .prop_map(|((ranks, experts, virtual_ranks, intra, network), h, f, top_k, activation, max_tokens, shared, router, hints)| {
            let mut topology = if virtual_ranks {
                vec!["gpus_per_node = 1".to_string(), format!("virtual_ranks = {ranks}")]
            } else {
                vec![format!("gpus_per_node = {ranks}"), "nodes = 1".to_string()]
            };
            topology.push(format!("nvlink = {intra}"));
            topology.push(format!("network = {network}"));
            let mut top_k = top_k;
            let mut layer = vec![
                format!("hidden = {}", h * 64),
                format!("ffn = {}", f * 64),
                format!("experts = {experts}"),
                format!("activation = {activation}"),
                "topology = t".to_string(),
                format!("parallel {{ expert = {ranks} }}"),
            ];
            if let Some(max_tokens) = max_tokens {
                layer.push(format!("max_tokens = {max_tokens}"));
            }
            // The shared experts' FFN is a multiple of the routed one, as the checker asks.
            if let Some((count, multiple, gated)) = shared {
                layer.push(format!(
                    "shared_experts {{ count = {count} ffn = {} gated = {gated} }}",
                    multiple * f * 64
                ));
            }
            if let Some((groups, rule, scale)) = router {
                let kept = groups.div_ceil(2);
                top_k = top_k.min(kept * experts / groups).max(1);
                // The three scorings, each with a bias; `normalize` never with topk_softmax.
                let (scoring, bias, normalize) = match rule {
                    0 => ("softmax", "none", " normalize = false"),
                    1 => ("sigmoid", "score_correction", " normalize = true"),
                    _ => ("topk_softmax", "logits", ""),
                };
                layer.push(format!(
                    "router {{ scoring = {scoring} bias = {bias} groups = {groups} groups_kept = {kept}{normalize} scale = {}.5 }}",
                    scale
                ));
            }
            layer.push(format!("top_k = {top_k}"));
            let orders = ["nearest_first", "rotate", "hierarchical"];
            let mut schedule = Vec::new();
            // Hints the planner accepts for every generated shape (64 columns divide every
            // ffn, the stages fit in shared memory), since the checker asks it.
            if hints[0] % 2 == 0 {
                schedule.push(format!("gemm1.tile = {}x64x64", 16 << (hints[1] % 4)));
            }
            if hints[1] % 3 == 0 {
                // A chunk is at most max_tokens (4096 when unset).
                let chunk = (1 + u32::from(hints[3])).min(max_tokens.unwrap_or(4096));
                schedule.push(format!("dispatch_chunk = {chunk} tokens"));
            }
            if hints[2] % 2 == 1 {
                schedule.push(format!("traffic = {}", orders[usize::from(hints[4] % 3)]));
            }
            if hints[5] % 2 == 0 {
                // At most 15 communication blocks: 8 virtual ranks have 16 SMs each.
                schedule.push(format!("stages = {} comm_blocks = {}", 2 + (hints[5] / 2) % 4, 1 + hints[3] % 15));
            }
            if hints[4] % 3 == 0 {
                schedule.push(format!("fused_decode = {} tokens", 1 + hints[0] % 32));
            }
            if !schedule.is_empty() {
                layer.push(format!("schedule {{ {} }}", schedule.join("  ")));
            }
            Spec { topology, layer }
        })
}

/// Lays the spec out with separators and comments chosen by `layout`.
fn render(spec: &Spec, layout: &[u8], layer_first: bool) -> String {
    let separators = [
        " ",
        "\n",
        "\n\n",
        "  # note\n",
        " // note\n",
        "\n# own line\n",
        "\t",
        // Windows and old Mac line breaks end lines and comments too.
        "\r\n",
        "\r",
        " # note\r",
        "\r\n// own line\r\n",
    ];
    let mut choice = layout.iter().cycle();
    let mut next = || separators[usize::from(*choice.next().unwrap_or(&0)) % separators.len()];
    let block =
        |kind: &str, name: &str, entries: &[String], next: &mut dyn FnMut() -> &'static str| {
            let mut text = format!("{kind} {name} {{{}", next());
            for entry in entries {
                text.push_str(entry);
                text.push_str(next());
            }
            text.push_str("}\n");
            text
        };
    let topology = block("topology", "t", &spec.topology, &mut next);
    let layer = block("layer", "l", &spec.layer, &mut next);
    if layer_first {
        format!("# generated\n{layer}\n{topology}")
    } else {
        format!("{topology}{layer}")
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn fmt_keeps_the_meaning_and_is_idempotent(
        spec in spec(),
        layout in prop::collection::vec(any::<u8>(), 1..64),
        layer_first in any::<bool>(),
        shuffle in any::<u64>(),
    ) {
        let mut spec = spec;
        // Entry order does not matter to the meaning.
        let len = spec.layer.len();
        spec.layer.rotate_left((shuffle as usize) % len);
        let source = render(&spec, &layout, layer_first);
        let module = compile_source("generated.moe", &source)
            .map_err(|diagnostics| TestCaseError::fail(format!("{source}\n{}", diagnostics.render())))?;
        let formatted = format_source("generated.moe", &source).map_err(|d| TestCaseError::fail(d.render()))?;
        let reformatted = format_source("formatted.moe", &formatted).map_err(|d| TestCaseError::fail(d.render()))?;
        prop_assert_eq!(&formatted, &reformatted, "fmt is idempotent");
        let again = compile_source("formatted.moe", &formatted).map_err(|d| TestCaseError::fail(d.render()))?;
        prop_assert_eq!(module, again, "fmt keeps the meaning");
        prop_assert_eq!(source.matches("note").count() + source.matches("own line").count() + source.matches("generated").count(),
            formatted.matches("note").count() + formatted.matches("own line").count() + formatted.matches("generated").count(),
            "fmt keeps every comment");
    }
}
