"""Markdown tables of the GPU proof's records (pasted into docs/gpu-proof.md).

python3 gpu_proof/table.py [results/gpu-proof/h100]
"""

import json
import sys
from pathlib import Path

ORDER = ["bf16", "awq-w4a16-g32-broad", "awq-w4a16-g32-mlp", "bf16-mtp1", "bf16-mtp2", "bf16-mtp4"]


def load(folder: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def main() -> None:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "results/gpu-proof/h100")
    records = load(folder)
    variants = {d["variant"]: d for d in records.values() if d["kind"] == "variant" and d["status"] == "ok"}
    names = [v for v in ORDER if v in variants]

    print("| variant | short 64→128 | medium 2048→256 | long 8192→256 | TTFT s/m/l | ITL s/m/l | varied text s/m/l |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        probe = variants[name]["probe"]
        cats = probe["categories"]
        med = [f"{c['median_ms']:.0f} ms" for c in cats]
        ttft = "/".join(f"{c['ttft_median_ms']:.0f}" for c in cats)
        itl = "/".join(f"{c['itl_median_ms']:.2f}" for c in cats)
        varied = "/".join(f"{c['median_ms']:.0f}" for c in probe["varied"]["categories"]) if probe["varied"] else "-"
        print(f"| {name} | {' | '.join(med)} | {ttft} ms | {itl} ms | {varied} ms |")
    print()
    print(
        "| variant | machine | cold start, first | cold start, baked cache | compile cache (files, MB) "
        "| baked start loaded the compile cache |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        cold = variants[name]["cold_start"]
        how = cold.get("first_start_cache")
        first = cold.get(f"{how}_cache_s")
        baked = cold.get("baked_cache_s")
        size = f"{cold['cache_files']}, {cold['cache_bytes'] / 1e6:.0f}" if "cache_files" in cold else "-"
        hits = cold.get("baked_start_log", {}).get("hits")
        baked_text = f"{baked:.0f} s" if baked else "-"
        print(
            f"| {name} | {variants[name]['machine']} | {first:.0f} s ({how}) | {baked_text} | {size} | "
            f"{'yes' if hits else '-'} |"
        )
    print()
    print(
        "| variant | weights read per step | bound (weights) | bound (+KV, state) at long | measured ITL s/m/l "
        "| fraction of bound s/m/l |"
    )
    print("|---|---|---|---|---|---|")
    for name in names:
        decode = variants[name]["decode"]
        rows = decode["categories"]
        itl = "/".join(f"{r['itl_median_ms']:.2f}" for r in rows)
        fraction = "/".join(f"{r['fraction_of_bound']:.2f}" for r in rows)
        print(
            f"| {name} | {decode['weights_bytes_per_step'] / 1e9:.2f} GB | {rows[0]['weights_bound_ms']:.2f} ms | "
            f"{rows[-1]['bound_with_kv_state_ms']:.2f} ms | {itl} ms | {fraction} |"
        )
    print()
    for name, data in records.items():
        if data["kind"] == "quantize":
            report = data["report"] or {}
            heldout = (report.get("checks") or {}).get("heldout") or {}
            print(
                f"quantize {data['variant']}: {data['status']}, {data['wall_s']} s wall (stage's own "
                f"{report.get('wall_seconds')} s), peak GPU {data['peak_gpu_memory_allocated_gib']} GiB allocated / "
                f"{data['peak_gpu_memory_reserved_gib']} GiB reserved, {report.get('quantized_modules')} modules, "
                f"size ratio {report.get('size_ratio')}, held-out agreement {heldout.get('top1_agreement')}, "
                f"ppl ratio {heldout.get('ppl_ratio')}"
            )
        if data["kind"] in ("bandwidth", "checkpoint"):
            keys = (
                ("copy_gbps", "read_gbps")
                if data["kind"] == "bandwidth"
                else ("total_params", "total_bytes", "build_s", "peak_gpu_memory_allocated_gib")
            )
            print(f"{name} ({data['machine']}): " + ", ".join(f"{k} {data[k]}" for k in keys))


if __name__ == "__main__":
    main()
