"""vLLM as the rollout engine: in the training process (``VLLMEngine``, like TRL's ``vllm_mode="colocate"``) or
as an OpenAI-compatible server in a process of its own (``VLLMServerEngine``, like ``trl vllm-serve``).

Both implement the engine boundary (``rollout.engine``) the same way:

* **Model.** ``setup`` writes the learner's policy (config, generation config, current weights) to a temporary
  Hugging Face directory and starts vLLM on it with no tokenizer (``skip_tokenizer_init``): prompts go in as
  token ids (``TokensPrompt``, or a list of ids to ``/v1/completions``) and come back as ids; EOS stops a row
  (``stop_token_ids``, and the EOS is one of its tokens).
* **Sampler contract.** ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token under
  ``softmax(top_p(logits / T))``, the distribution the project's engines record, in fp32 with ``dtype
  float32``. ``n`` samples per prompt in one request (its ``n`` rows contiguous). A training batch's draws are
  seeded per prompt from ``SamplingParams.seed``, so the same seed gives the same tokens. Held-out (greedy)
  rollouts run at temperature 0: the tokens are the argmax of the raw logits, and the log-probs vLLM returns
  for them are the untempered ones (nothing reads them).
* **Weights.** ``load_weights`` hands the learner's state dict to every worker's ``load_learner_weights``
  (``rollout.vllm_worker``: vLLM's in-place ``reload_weights``, then a tied output embedding re-tied), resets the
  prefix cache (cached KV of the old weights must not be reused) and records the version.
* **Capabilities.** ``SESSIONS`` (multi-turn: ``sessions.ResubmitSession`` re-sends each row's exact history,
  which vLLM's prefix cache keeps cheap) and ``TOPK`` (vLLM's top log-probs of the sampling distribution, at
  most ``max_logprobs``). Not ``AUX_DRAWS`` (vLLM draws once per position) and not ``IN_PROCESS``: a
  configuration that needs either is refused at setup in one line.

vLLM is an optional dependency (``./install_vllm.sh`` makes ``.venv-vllm``; docs/scaling.md): nothing here
imports it until an engine is set up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from rl_lightning.models.adapters import has_adapters, merged_state_dict
from rl_lightning.rollout.engine import SESSIONS, TOPK, EngineSession, RolloutEngine, SamplingParams, \
    check_capabilities
from rl_lightning.rollout.generation import Generation
from rl_lightning.rollout.serving import ServerProcess, free_port, post_json
from rl_lightning.rollout.sessions import ResubmitSession
from rl_lightning.rollout.vllm_worker import EXTENSION

__all__ = ["VLLMEngine", "VLLMServerEngine"]

#: per row: sampled ids, their log-probs, finish reason ("stop" / "length"), per-id (topk ids, topk log-probs)
Row = tuple[list[int], list[float], str, list | None]


def prompt_seed(seed: int | None, index: int) -> int | None:
    """The seed of prompt ``index`` of a batch whose draws are seeded by ``seed`` (``None``: unseeded)."""
    return None if seed is None else (seed * 1_000_003 + index) % (2**63 - 1)


def write_model_dir(policy: nn.Module, path: Path, dtype: str | None = None,
                    state: Mapping[str, Tensor] | None = None) -> Path:
    """Save ``policy`` (config, generation config, weights ``state`` or its own) as a Hugging Face directory at
    ``path``, written under a temporary name and renamed, so a reader never sees half a checkpoint."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=dict(state) if state is not None else None, safe_serialization=True)
    if dtype is not None:  # the serving dtype goes into the config vLLM reads ("auto")
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _dtype_name(policy: nn.Module, dtype: str | None) -> str:
    return dtype or str(next(policy.parameters()).dtype).removeprefix("torch.")


def _topk(entries: Iterable[tuple[int, float]], k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely ``(id, log-prob)`` of one position (vLLM adds the sampled id when it is not among
    them), as tensors ``[k]``."""
    best = sorted(entries, key=lambda e: -e[1])[:k]
    return torch.tensor([i for i, _ in best], dtype=torch.long), torch.tensor([lp for _, lp in best])


class _VLLMBase(RolloutEngine):
    """What both vLLM engines share: sampling settings, the output layout, sessions."""

    capabilities = frozenset({SESSIONS, TOPK})

    def __init__(self, max_logprobs: int = 1, max_model_len: int | None = None, seed: int = 0,
                 engine_args: dict[str, Any] | None = None) -> None:
        self.max_logprobs, self.max_model_len, self.seed = max_logprobs, max_model_len, seed
        self.engine_args = dict(engine_args or {})
        self.version = -1
        self._workdir: Path | None = None

    def _request(self, params: SamplingParams, n: int, max_tokens: int, seed: int | None) -> dict[str, Any]:
        """One request's sampling settings (vLLM's ``SamplingParams`` fields)."""
        if params.topk > self.max_logprobs:
            raise ValueError(f"{type(self).__name__}: topk={params.topk} exceeds max_logprobs="
                             f"{self.max_logprobs}; raise the engine's max_logprobs")
        greedy = params.greedy
        return dict(n=n, max_tokens=max_tokens, temperature=0.0 if greedy else params.temperature,
                    top_p=1.0 if greedy else params.top_p, seed=None if greedy else seed,
                    logprobs=params.topk, stop_token_ids=[params.eos_token_id])

    def _complete(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int, budgets: Sequence[int],
                  seeds: Sequence[int | None]) -> list[Row]:
        """``n`` rows for every prompt (its budget and seed), a prompt's rows contiguous."""
        raise NotImplementedError

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> Generation:
        check_capabilities(self, params.needs())
        rows = self._complete(prompts, params, n, [params.max_tokens] * len(prompts),
                              [prompt_seed(params.seed, i) for i in range(len(prompts))])
        gen = Generation.from_lists([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                    params.pad_token_id)
        if params.topk:
            gen.topk_ids = torch.zeros((*gen.response_ids.shape, params.topk), dtype=torch.long)
            gen.topk_logprobs = torch.zeros((*gen.response_ids.shape, params.topk))
            for i, row in enumerate(rows):
                for t, (ids, lps) in enumerate(row[3]):
                    gen.topk_ids[i, t], gen.topk_logprobs[i, t] = ids, lps
        return gen

    def open_session(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                     carry_cache: bool = True) -> EngineSession:
        check_capabilities(self, params.needs())

        def complete(histories: list[list[int]], budgets: list[int], seeds: list[int | None]) -> list[Row]:
            return self._complete(histories, params, 1, budgets, seeds)

        return ResubmitSession(complete, prompts, params)

    def _model_dir(self, policy: nn.Module, dtype: str | None) -> Path:
        self._workdir = Path(tempfile.mkdtemp(prefix="rl_lightning_vllm_"))
        return write_model_dir(policy, self._workdir / "model", _dtype_name(policy, dtype),
                               merged_state_dict(policy) if has_adapters(policy) else None)

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


class VLLMEngine(_VLLMBase):
    """vLLM's offline ``LLM`` in the training process (colocated; see the module docstring).

    Args:
        max_logprobs: the most top-k log-probs a request may ask for (``data.record.topk``).
        max_model_len: the longest sequence (``None``: the model's ``max_position_embeddings``).
        seed: vLLM's own seed (unseeded requests; training batches are seeded per prompt).
        kv_cache_gib: memory for vLLM's KV cache, GiB (on CPU ``VLLM_CPU_KVCACHE_SPACE``; on a GPU it is turned
            into ``kv_cache_memory_bytes``).
        engine_args: more keyword arguments for ``vllm.LLM`` (e.g. ``{"gpu_memory_utilization": 0.3}``).

    vLLM changes its process when it starts in it: it seeds the global RNGs and replaces ``torch.set_num_threads``
    by a no-op. ``setup`` keeps the caller's RNG state and thread count and puts ``torch.set_num_threads`` back,
    so a run is the same with or without the engine's start-up in it. vLLM's CPU thread binding is off
    (``VLLM_CPU_OMP_THREADS_BIND=nobind``, unless set): the trainer's threads share the cores.
    """

    def __init__(self, max_logprobs: int = 1, max_model_len: int | None = None, seed: int = 0,
                 kv_cache_gib: float = 1.0, engine_args: dict[str, Any] | None = None) -> None:
        super().__init__(max_logprobs, max_model_len, seed, engine_args)
        self.kv_cache_gib = kv_cache_gib
        self.llm: Any = None

    def setup(self, policy: nn.Module, dtype: str | None = None, version: int = 0) -> None:
        if self.llm is not None:  # already running (a checkpoint was loaded): take the weights
            self.load_weights(merged_state_dict(policy), version)
            return
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        cuda = next(policy.parameters()).is_cuda
        memory = {"kv_cache_memory_bytes": int(self.kv_cache_gib * 2**30)} if cuda else {}
        if not cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(self.kv_cache_gib))))
        path = self._model_dir(policy, dtype)
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        states = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            from vllm import LLM

            self.llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=_dtype_name(policy, dtype),
                           enforce_eager=True, logprobs_mode="processed_logprobs",
                           max_logprobs=max(1, self.max_logprobs), max_model_len=self.max_model_len,
                           seed=self.seed, worker_extension_cls=EXTENSION,
                           **({"gpu_memory_utilization": 0.05} if not cuda else {}), **memory, **self.engine_args)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0])
        np.random.set_state(states[1])
        self.version = version

    def load_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], version: int
                     ) -> None:
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self.llm.collective_rpc("load_learner_weights", kwargs={"weights": [(k, v.detach()) for k, v in items]})
        self.llm.reset_prefix_cache()
        self.version = version

    def _complete(self, prompts, params, n, budgets, seeds) -> list[Row]:  # noqa: ANN001
        from vllm import SamplingParams as VLLMParams
        from vllm.inputs import TokensPrompt

        requests = [VLLMParams(**self._request(params, n, b, s), detokenize=False) for b, s in zip(budgets, seeds)]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], requests,
                                    use_tqdm=False)
        rows: list[Row] = []
        for out in outputs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                logps = [float(lp[t].logprob) for lp, t in zip(c.logprobs, ids)]
                extras = [_topk(((i, e.logprob) for i, e in lp.items() if e.rank <= params.topk), params.topk)
                          for lp in c.logprobs] if params.topk else None
                rows.append((ids, logps, "stop" if c.finish_reason == "stop" else "length", extras))
        return rows

    def close(self) -> None:
        if self.llm is not None:
            engine = getattr(self.llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
        self._remove_workdir()


class VLLMServerEngine(_VLLMBase):
    """A vLLM OpenAI-compatible server in a process of its own (see the module docstring), or one already running.

    ``setup`` starts ``python -m vllm.entrypoints.openai.api_server`` on ``127.0.0.1`` and a free port under the
    library's guard (``rollout.serving``: the server never outlives the training process, whatever ends it), with
    ``python``: the interpreter of a venv that has vLLM (default ``.venv-vllm/bin/python`` where it exists, else
    this one; vLLM's pins may conflict with the trainer's, so it can live in a venv of its own). It waits until
    ``/health`` answers. Requests go out concurrently (``concurrency`` at a time, one per prompt, so the server
    batches them while the caller waits, or while the learner updates under ``data.async_rollout``) to
    ``/v1/completions`` with token ids in and out.

    Weight sync: ``load_weights`` writes the state dict as safetensors to a directory under the engine's temporary
    directory (under a temporary name, renamed when complete), then calls ``/collective_rpc`` ->
    ``load_learner_weights(weights_path=...)`` (the server runs with ``VLLM_SERVER_DEV_MODE=1``) and
    ``/reset_prefix_cache``; the previous version's directory is removed.

    Args:
        url: an already-running server (``http://host:port``) instead of starting one: it must serve this
            policy's architecture with this module's worker extension
            (``--worker-extension-cls rl_lightning.rollout.vllm_worker.WeightSync``), dev mode, and see
            ``weights_dir``; the library never stops it.
        weights_dir: where weight versions are written (``None``: the engine's temporary directory; with ``url``,
            a directory the server can read, e.g. on a shared file system).
        python: the server's interpreter (default: ``$RL_LIGHTNING_VLLM_PYTHON``, else ``.venv-vllm/bin/python``
            where it exists, else this interpreter).
        startup_timeout: seconds to wait for the server to answer ``/health``.
        concurrency: requests in flight at once.
        server_args: more command-line arguments for the server.
        max_logprobs, max_model_len, seed: as for ``VLLMEngine``.
        kv_cache_gib: the server's KV-cache memory, GiB (CPU: ``VLLM_CPU_KVCACHE_SPACE``).
    """

    def __init__(self, url: str | None = None, weights_dir: str | None = None, python: str | None = None,
                 startup_timeout: float = 300.0, concurrency: int = 64, server_args: list[str] | None = None,
                 max_logprobs: int = 1, max_model_len: int | None = None, seed: int = 0,
                 kv_cache_gib: float = 1.0) -> None:
        super().__init__(max_logprobs, max_model_len, seed)
        self.url, self.weights_dir, self.startup_timeout = url, weights_dir, startup_timeout
        default = os.environ.get("RL_LIGHTNING_VLLM_PYTHON", ".venv-vllm/bin/python")
        self.python = python or (default if Path(default).exists() else None)
        self.concurrency, self.server_args, self.kv_cache_gib = concurrency, list(server_args or []), kv_cache_gib
        self.server: ServerProcess | None = None
        self.model_name: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._loaded: Path | None = None

    def setup(self, policy: nn.Module, dtype: str | None = None, version: int = 0) -> None:
        if self.model_name is not None:  # running: take the weights
            self.load_weights(merged_state_dict(policy), version)
            return
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="vllm-request")
        if self.url is not None:
            self.url = self.url.rstrip("/")
            if self.weights_dir is None:
                self._workdir = Path(tempfile.mkdtemp(prefix="rl_lightning_vllm_"))
            self.model_name = _get_json(self.url + "/v1/models")["data"][0]["id"]
            self.load_weights(merged_state_dict(policy), version)
            return
        path = self._model_dir(policy, dtype)
        port = free_port()
        command = [self.python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
                   "--skip-tokenizer-init", "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", _dtype_name(policy, dtype), "--enforce-eager", "--logprobs-mode", "processed_logprobs",
                   "--max-logprobs", str(max(1, self.max_logprobs)), "--seed", str(self.seed),
                   "--worker-extension-cls", EXTENSION, *(["--max-model-len", str(self.max_model_len)]
                                                          if self.max_model_len else []), *self.server_args]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(self.kv_cache_gib)))}
        self.url = f"http://127.0.0.1:{port}"
        self.server = ServerProcess(command, self.url + "/health", self._workdir / "server.log", env)
        self.server.wait_ready(self.startup_timeout)
        self.model_name = str(path)
        self.version = version

    def load_weights(self, named_tensors: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]], version: int
                     ) -> None:
        from safetensors.torch import save_file

        state = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        root = Path(self.weights_dir) if self.weights_dir else self._workdir
        path = root / f"weights_v{version}"
        tmp = root / f".weights_v{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_unshared(state), str(tmp / "model.safetensors"))
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        post_json(self.url + "/collective_rpc", {"method": "load_learner_weights",
                                                 "kwargs": {"weights_path": str(path)}})
        post_json(self.url + "/reset_prefix_cache")
        if self._loaded is not None and self._loaded != path:
            shutil.rmtree(self._loaded, ignore_errors=True)
        self._loaded, self.version = path, version

    def _one(self, prompt: Sequence[int], request: dict[str, Any], topk: int) -> list[Row]:
        body = {"model": self.model_name, "prompt": list(prompt), **request, "logprobs": max(topk, 0),
                "return_tokens_as_token_ids": True, "return_token_ids": True, "skip_special_tokens": False}
        answer = post_json(self.url + "/v1/completions", body)
        rows: list[Row] = []
        for choice in sorted(answer["choices"], key=lambda c: c["index"]):
            ids = [int(t) for t in choice["token_ids"]]
            logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            extras = [_topk(((int(k.removeprefix("token_id:")), v) for k, v in top.items()), topk)
                      for top in choice["logprobs"]["top_logprobs"]] if topk else None
            rows.append((ids, logps, "stop" if choice["finish_reason"] == "stop" else "length", extras))
        return rows

    def _complete(self, prompts, params, n, budgets, seeds) -> list[Row]:  # noqa: ANN001
        futures = [self._pool.submit(self._one, p, self._request(params, n, b, s), params.topk)
                   for p, b, s in zip(prompts, budgets, seeds)]
        return [row for f in futures for row in f.result()]

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self.model_name = None
        self._remove_workdir()


def _unshared(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` on the CPU with one name per storage (tied weights share one: safetensors refuses to write both;
    vLLM ties the other name to it on load)."""
    kept: dict[str, Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor.detach().to("cpu").contiguous()
    return kept


def _get_json(url: str, timeout: float = 30.0) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.loads(answer.read())
