# The regimes whose tuned GEMMs differ from the shipped entries for this GPU: one line per
# regime, "model tokens,tokens,tokens" (the entry's timed tokens), for check.sh; a summary
# of each change on stderr. Usage: changed.py SHIPPED.json CACHE_DIR MODEL...
import json, sys

def key(e):
    return (e["gpu"], json.dumps(e["shape"], sort_keys=True), e["min_tokens"], e["max_tokens"])

def gemm(g):
    t = g["tile"]
    return f'{g["engine"]} {t["m"]}x{t["n"]}x{t["k"]} s{g["stages"]} c{g["cluster"]}'

shipped = {key(e): e for e in json.load(open(sys.argv[1]))["entries"]}
for model in sys.argv[3:]:
    try:
        entries = json.load(open(f"{sys.argv[2]}/{model}.json"))["entries"]
    except (OSError, ValueError) as error:
        print(f"{model}: no tuned entries ({error})", file=sys.stderr)
        continue
    for e in entries:
        old = shipped.get(key(e))
        regime = f'{model} {e["min_tokens"]}..={e["max_tokens"]}'
        if old is None:
            print(f"{regime}: new entry (none shipped): {gemm(e['gemm1'])} / {gemm(e['gemm2'])}", file=sys.stderr)
        elif old["gemm1"] == e["gemm1"] and old["gemm2"] == e["gemm2"]:
            print(f"{regime}: as shipped", file=sys.stderr)
            continue
        else:
            print(f"{regime}: shipped {gemm(old['gemm1'])} / {gemm(old['gemm2'])} -> tuned {gemm(e['gemm1'])} / {gemm(e['gemm2'])}"
                  f" ({e['measured_us']:.1f} us vs cost model's {e['model_choice_us']:.1f})", file=sys.stderr)
        print(model, ",".join(str(t) for t in e["timed_tokens"]))
