"""Peak memory of per-token log-probs (+ entropy) at a real vocabulary: naive vs chunked ``sampling_logprobs``.

Setting (SmolLM2-135M-like head): hidden ``[B, T, H=576]`` @ ``W [H, V=49152]`` gives the logits, a non-leaf
activation exactly like the lm_head output in ``RLModule.forward_policy``; then log-probs of the sampled tokens
(and optionally the entropy), a policy-gradient-style loss ``-Σ w·A·logp (- β·H)``, and backward to ``hidden``
and ``W``. What is measured is the memory on top of the inputs (``hidden``, ``W``, tokens) for
"forward + loss + backward", which includes the logits themselves and their gradient.

Variants:
    naive        ``log_softmax(sampling_logits(logits)).gather(...)`` on the whole ``[B, T, V]`` (the previous
                 implementation with one chunk), entropy ``-Σ p log p`` with plain autograd.
    chunked-N    ``sampling_logprobs(..., chunk_size=N)`` (N positions per chunk; custom autograd function that
                 saves only the logits and recomputes each chunk's softmax in backward).
    overwrite-N  ``chunked-N`` with ``overwrite_logits=True`` (what ``policy_forward`` runs): the backward writes the
                 logits' gradient over the logits instead of into a new ``[B, T, V]`` buffer.
    ckpt-N       the rejected alternative: ``torch.utils.checkpoint`` around each N-position chunk (row slices of
                 the logits). Slicing's backward allocates a full-size zero gradient per chunk, so its peak is
                 *higher* than naive's; kept here as the evidence for the custom autograd function.

Method (CPU). Each (variant, B, entropy) runs in a fresh subprocess so that high-water marks do not leak
between variants. Inside it:
    1. RSS: ``ru_maxrss`` (``getrusage(RUSAGE_SELF)``, the process's peak resident set) after the computation,
       minus the current resident set read from ``/proc/self/statm`` just before it. The setup avoids
       temporaries bigger than what stays alive, and the script checks that ``ru_maxrss`` before the run is
       not above that baseline (otherwise the figure would be an under-estimate and is flagged with ``!``).
       Tensors of more than 32 MB are ``mmap``-ed by glibc and returned on free, so RSS follows live tensors.
    2. Allocator: the same computation again under ``torch.profiler`` (``profile_memory=True``), replaying its
       allocation timeline (create/destroy of every tensor storage) to get the peak of live bytes allocated
       during the computation (``--no-profiler`` skips it; it is a private API and may be missing).
Both are expressed in "copies": one copy = ``B·T·V·4`` bytes, the size of a float32 ``[B, T, V]`` tensor.
The values (log-probs, entropy) and the gradient w.r.t. ``hidden`` are compared with the naive variant's.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_logprob_memory.py`` (about 10-20 min on 2 CPU cores;
``--batch 4 --entropy on`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_lightning.functional.logprobs import (  # noqa: E402
    chunk_values_autograd,
    position_chunks,
    sampling_log_softmax,
    sampling_logprobs,
)

V, T, H = 49_152, 512, 576
TEMPERATURE, TOP_P, ENT_COEF = 1.0, 1.0, 0.01


# ---------------------------------------------------------------------------------------------------------------
# the variants
# ---------------------------------------------------------------------------------------------------------------


def naive(logits, tokens, with_entropy):
    logp_all = sampling_log_softmax(logits, TEMPERATURE, TOP_P, keep=tokens)  # [B, T, V]
    lp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return lp, None
    p = logp_all.exp()
    return lp, -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)


def chunked(chunk_size):
    def fn(logits, tokens, with_entropy):
        return sampling_logprobs(logits, tokens, TEMPERATURE, TOP_P, chunk_size, with_entropy)
    return fn


def overwriting(chunk_size):
    def fn(logits, tokens, with_entropy):
        return sampling_logprobs(logits, tokens, TEMPERATURE, TOP_P, chunk_size, with_entropy, overwrite_logits=True)
    return fn


def checkpointed(chunk_size):
    from torch.utils.checkpoint import checkpoint

    def fn(logits, tokens, with_entropy):
        B, T_ = tokens.shape
        lp = torch.empty(B, T_, device=logits.device)  # filled by (differentiable) slice assignment
        ent = torch.empty(B, T_, device=logits.device) if with_entropy else None
        for idx in position_chunks(B, T_, chunk_size):
            a, e = checkpoint(chunk_values_autograd, logits[idx], tokens[idx].unsqueeze(-1), TEMPERATURE, TOP_P,
                              with_entropy, use_reentrant=False)
            lp[idx] = a.squeeze(-1)
            if with_entropy:
                ent[idx] = e
        return lp, ent
    return fn


def make_variant(name):
    if name == "naive":
        return naive
    kind, _, n = name.partition("-")
    return {"chunked": chunked, "overwrite": overwriting, "ckpt": checkpointed}[kind](int(n))


# ---------------------------------------------------------------------------------------------------------------
# one measurement (child process)
# ---------------------------------------------------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _setup(batch, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, T, H, generator=gen).requires_grad_(True)
    weight = torch.randn(H, V, generator=gen).mul_(H ** -0.5 * 3).requires_grad_(True)  # logits std ≈ 3
    tokens = torch.randint(0, V, (batch, T), generator=gen)
    adv = torch.randn(batch, 1, generator=gen)
    return hidden, weight, tokens, adv


def _step(fn, hidden, weight, tokens, adv, with_entropy):
    """forward (lm_head + log-probs) + loss + backward; returns the (detached) log-probs and entropy."""
    lp, ent = fn(hidden @ weight, tokens, with_entropy)  # the logits are referenced by nobody but `fn`
    loss = -(lp * adv).mean()
    if with_entropy:
        loss = loss - ENT_COEF * ent.mean()
    loss.backward()
    return lp.detach(), None if ent is None else ent.detach()


def _profiler_peak(fn, batch, with_entropy):
    from torch.profiler import ProfilerActivity, profile

    hidden, weight, tokens, adv = _setup(batch)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        _step(fn, hidden, weight, tokens, adv, with_entropy)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:  # private API: allocation timeline
        if action.name == "CREATE":
            live += size
        elif action.name == "DESTROY":
            live -= size
        peak = max(peak, live)
    return peak


def child(variant, batch, with_entropy, out_path, profiler):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fn = make_variant(variant)
    hidden, weight, tokens, adv = _setup(batch)
    before = _rss()
    clean = _maxrss() <= before + (8 << 20)  # the high-water mark is (about) the baseline
    start = time.perf_counter()
    lp, ent = _step(fn, hidden, weight, tokens, adv, with_entropy)
    seconds = time.perf_counter() - start
    peak_rss = _maxrss() - before
    result = {"peak_rss": peak_rss, "clean": clean, "seconds": seconds}
    torch.save({"lp": lp, "ent": ent, "grad_hidden": hidden.grad}, out_path)
    del hidden, weight, lp, ent
    if profiler:
        try:
            result["peak_alloc"] = _profiler_peak(fn, batch, with_entropy)
        except Exception as exc:  # noqa: BLE001 - private profiler API
            result["profiler_error"] = repr(exc)
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--entropy", choices=["off", "on", "both"], default="both")
    parser.add_argument("--variants", nargs="+", default=["naive", "chunked-1024", "chunked-256", "overwrite-256",
                                                                "ckpt-1024"])
    parser.add_argument("--no-profiler", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("VARIANT", "B", "ENTROPY", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, batch, ent, out = args.child
        child(variant, int(batch), ent == "on", out, not args.no_profiler)
        return

    entropies = {"off": [False], "on": [True], "both": [False, True]}[args.entropy]
    variants = ["naive"] + [v for v in args.variants if v != "naive"]  # naive first: the reference values
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"V={V} T={T} H={H} float32 logits, temperature={TEMPERATURE} top_p={TOP_P}, torch {torch.__version__}; "
          f"one copy = B*T*V*4 bytes")
    header = (f"{'B':>2} {'entropy':>7} {'variant':<13} {'RSS peak MB':>11} {'copies':>6} {'alloc peak MB':>13} "
              f"{'copies':>6} {'max|Δlogp|':>10} {'max|Δent|':>9} {'rel Δgrad':>9} {'time s':>6}")
    rows, agreed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batch:
            copy = batch * T * V * 4
            for with_entropy in entropies:
                ref = None
                for variant in variants:
                    out = os.path.join(tmp, f"{variant}_{batch}_{with_entropy}.pt")
                    cmd = [sys.executable, __file__, "--child", variant, str(batch), "on" if with_entropy else "off",
                           out] + (["--no-profiler"] if args.no_profiler else [])
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                    if proc.returncode != 0:
                        print(proc.stdout, proc.stderr, file=sys.stderr)
                        raise SystemExit(f"{variant} B={batch} failed")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                    vals = torch.load(out)
                    os.remove(out)
                    if ref is None:
                        ref = vals
                    d_lp = (vals["lp"] - ref["lp"]).abs().max().item()
                    d_ent = (vals["ent"] - ref["ent"]).abs().max().item() if with_entropy else float("nan")
                    d_grad = ((vals["grad_hidden"] - ref["grad_hidden"]).norm() / ref["grad_hidden"].norm()).item()
                    agreed.append(d_lp <= 1e-4 and (not with_entropy or d_ent <= 1e-4) and d_grad <= 1e-5)
                    alloc = res.get("peak_alloc")
                    row = (f"{batch:>2} {'on' if with_entropy else 'off':>7} {variant:<13} "
                           f"{res['peak_rss'] / 2**20:>10.0f}{' ' if res['clean'] else '!'} "
                           f"{res['peak_rss'] / copy:>6.2f} "
                           + (f"{alloc / 2**20:>13.0f} {alloc / copy:>6.2f} " if alloc is not None else
                              f"{'n/a':>13} {'n/a':>6} ")
                           + f"{d_lp:>10.1e} {d_ent:>9.1e} {d_grad:>9.1e} {res['seconds']:>6.1f}")
                    rows.append(row)
                    print(row if len(rows) > 1 else header + "\n" + row, flush=True)
    print("all variants agree with naive (|Δlogp|, |Δent| <= 1e-4, rel Δgrad <= 1e-5)" if all(agreed) else
          "DISAGREEMENT: see the rows above")
    if not all(agreed):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
