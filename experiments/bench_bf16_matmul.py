"""fp32 against bf16 matrix products on this CPU, under each oneDNN instruction-set cap: where bf16 pays.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_bf16_matmul.py [--n 1024] [--repeats 3]

Each cap (``ONEDNN_MAX_CPU_ISA``: unset, ``AVX512_CORE_BF16``, ``AVX512_CORE``, ``AVX2``; the study harness's kernel
sets ``avx512_bf16``, ``avx512`` and ``avx2`` pin the last three) runs in a subprocess of its own (oneDNN reads the
cap once), which times ``torch.matmul`` of two ``n x n`` matrices in fp32 and in bf16 (best of ``--repeats`` after a
warm-up) and prints both rates, their ratio and ``algorithms.checks.native_bf16()`` (what the library's setup warning
uses). Where the CPU lacks AVX512-BF16 and AMX, oneDNN emulates bf16 under every cap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CAPS = (None, "AVX512_CORE_BF16", "AVX512_CORE", "AVX2")


def worker(n: int, repeats: int) -> dict:
    import time

    import torch

    from rl_lightning.algorithms.checks import native_bf16

    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.matmul(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - start)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / best
    return {**rates, "native_bf16": native_bf16(), "threads": torch.get_num_threads()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1024, help="matrix size")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.n, args.repeats)))
        return
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "") if os.path.exists(
        "/proc/cpuinfo") else ""
    print(f"CPU bf16 instructions: {', '.join(f for f in ('avx512_bf16', 'amx_bf16') if f' {f}' in flags) or 'none'}")
    print("| ONEDNN_MAX_CPU_ISA | fp32 GFLOP/s | bf16 GFLOP/s | bf16 / fp32 | native_bf16() |")
    print("| --- | --- | --- | --- | --- |")
    for cap in CAPS:
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        out = subprocess.run([sys.executable, __file__, "--worker", "--n", str(args.n), "--repeats",
                              str(args.repeats)], env=env, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {cap or '(unset)'} | {r['float32'] / 1e9:.1f} | {r['bfloat16'] / 1e9:.1f} | "
              f"{r['bfloat16'] / r['float32']:.2f} | {r['native_bf16']} |", flush=True)
    print(f"({r['threads']} thread(s); n = {args.n}, best of {args.repeats})")


if __name__ == "__main__":
    main()
