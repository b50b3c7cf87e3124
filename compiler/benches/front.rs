//! Front-end speed: lex + parse + check (`compile_source`) of every example, plus lexing
//! alone, parsing alone and a 1 MB file of layers for throughput.

use std::path::Path;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use moeforge_compiler::{compile_source, front, parse};

fn examples() -> Vec<(String, String)> {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dsl-examples");
    let mut files: Vec<(String, String)> = std::fs::read_dir(directory)
        .expect("dsl-examples exists")
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "moe"))
        .map(|path| {
            let name = path
                .file_stem()
                .and_then(|stem| stem.to_str())
                .unwrap_or("?")
                .to_string();
            (
                name,
                std::fs::read_to_string(&path).expect("readable example"),
            )
        })
        .collect();
    files.sort();
    files
}

fn bench_examples(c: &mut Criterion) {
    let mut group = c.benchmark_group("compile_source");
    for (name, text) in examples() {
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_function(&name, |b| {
            b.iter(|| compile_source(&name, std::hint::black_box(&text)))
        });
    }
    group.finish();

    let (_, deepseek) = examples()
        .into_iter()
        .find(|(name, _)| name == "deepseek_v3")
        .expect("deepseek_v3.moe");
    let mut stages = c.benchmark_group("stages_deepseek_v3");
    stages.bench_function("lex", |b| {
        b.iter(|| front::lexer::lex(std::hint::black_box(&deepseek)))
    });
    stages.bench_function("lex_parse", |b| {
        b.iter(|| parse(std::hint::black_box(&deepseek)))
    });
    stages.bench_function("lex_parse_check", |b| {
        b.iter(|| compile_source("d", std::hint::black_box(&deepseek)))
    });
    stages.finish();

    let (_, tiny) = examples()
        .into_iter()
        .find(|(name, _)| name == "tiny")
        .expect("tiny.moe");
    let layer = tiny
        .split("layer tiny")
        .nth(1)
        .expect("tiny.moe has a layer");
    let topology = tiny.split("layer tiny").next().unwrap_or_default();
    let mut big = topology.to_string();
    let mut index = 0;
    while big.len() < 1_000_000 {
        big.push_str(&format!("layer tiny_{index}{layer}"));
        index += 1;
    }
    let mut throughput = c.benchmark_group("throughput");
    throughput.throughput(Throughput::Bytes(big.len() as u64));
    throughput.sample_size(10);
    throughput.bench_function("1MB_of_layers", |b| {
        b.iter(|| compile_source("big", std::hint::black_box(&big)))
    });
    throughput.finish();
}

criterion_group!(benches, bench_examples);
criterion_main!(benches);
