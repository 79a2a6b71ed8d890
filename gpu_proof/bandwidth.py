"""GPU memory bandwidth as torch sees it: device-to-device copy (bytes read + bytes written) and a read-only
reduction, on buffers far larger than the L2 cache.

    python3 gpu_proof/bandwidth.py RESULT_JSON
"""

import json
import sys
import time


def timed(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    import torch

    started = time.monotonic()
    nbytes = 4 << 30  # 4 GiB per buffer
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20)
    read_s = timed(lambda: src.sum(dtype=torch.float32), 20)
    result = {
        "kind": "bandwidth",
        "status": "ok",
        "device": torch.cuda.get_device_name(0),
        "buffer_bytes": nbytes,
        "iterations": 20,
        "method": "torch Tensor.copy_ between two 4 GiB bf16 CUDA tensors (GB/s counts bytes read + written), "
        "and Tensor.sum over one (bytes read); CUDA-event timed, 3 warm-ups",
        "copy_gbps": round(2 * nbytes / copy_s / 1e9, 1),
        "read_gbps": round(nbytes / read_s / 1e9, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle, indent=2, sort_keys=True)
        handle.write("\n")
    print(result, flush=True)


if __name__ == "__main__":
    main()
