"""On one CUDA GPU (skipped without CUDA, and without Ray): on each back end, a few GRPO steps of the default
recipe through `python -m nemo_grpo.train` in bf16, and the bf16 policy against fp32 Hugging Face.

    python -m pytest tests/functional/test_gpu.py -v -rs      # or: -m gpu over the whole suite

The runs of the entry point are also marked slow. The Megatron cases skip where megatron-core is not installed.
Generation is the torch engine (no vLLM needed): it samples on the CPU in fp32 from the fp32 master weights the
policy exports after every step.
"""

import math
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("ray", reason="the policy workers are Ray actors (pip install ray)")

from policy_checks import (PACKING, check_bf16_step, make_batch, packed_attention_kernels,  # noqa: E402
                           policy_config)
from train_runs import builtin_model_cache, read_metrics, run_train  # noqa: E402,F401 (autouse fixture)

from nemo_grpo.backends.model_inputs import model_inputs  # noqa: E402
from nemo_grpo.backends.varlen import CALLS, packed_attention, sdpa_per_segment  # noqa: E402
from nemo_grpo.config import ClusterConfig  # noqa: E402
from nemo_grpo.policy import Policy  # noqa: E402

BACKENDS = ["dtensor", "megatron"]
ONE_GPU = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1)
STEPS = 6
# the default recipe on world size 1 (one GPU: NCCL, chosen by init_torch_distributed), bf16 compute with fp32
# master weights, the torch generation engine; validation at start and end, a checkpoint at the last step
ONE_GPU_RUN = ("cluster.gpus_per_node=1", "cluster.num_nodes=1", "policy.precision=bfloat16",
               "policy.generation.backend=torch", f"grpo.max_num_steps={STEPS}")
# token_mult_prob_error = mean over generated tokens of exp(|policy - generation log-prob|). Both sides use the
# same (fp32 master) weights but not the same arithmetic: the engine computes in fp32 on the CPU, the policy in
# bf16 on the GPU (weights rounded to bf16's 8-bit mantissa, bf16 activations, other kernels). This same run in
# bf16 on a CPU logged at most 1.009 (DTensor) and 1.006 (Megatron) over its 6 steps, so 1.05 leaves ~5x
# headroom for the GPU's kernels; in fp32 it stays under 1.001 (test_grpo_e2e), and a refit that delivered
# wrong or stale weights, or a temperature that differs between engine and policy, lands far above 1.05.
MAX_TOKEN_MULT_PROB_ERROR = 1.05
# Policy.__init__'s start-up line, e.g. "policy: 1 dtensor worker(s) on cuda:0, torch.distributed nccl, ..."
POLICY_STARTED = re.compile(r"policy: (\d+) (\w+) worker\(s\) on ([\w:, ]+), torch\.distributed (\w+)")


def require_backend(backend: str) -> None:
    if backend == "megatron":
        pytest.importorskip("megatron.core", reason="the megatron back end needs megatron-core")


def assert_policy_ran_on_gpu(driver_log: str, backend: str) -> None:
    """The trainer's log names the policy workers' device and process-group backend: one rank on cuda:0, NCCL."""
    started = POLICY_STARTED.findall(driver_log)
    assert started, "no policy start-up line in the driver's log:\n" + driver_log[-3000:]
    assert started == [("1", backend, "cuda:0", "nccl")], started


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_default_recipe_steps_on_one_gpu(tmp_path, backend):
    """configs/grpo_tiny_cpu.yaml for STEPS steps: every step's reward finite and in [0, 1], loss and gradient
    norm finite, generation and training log-probs within bf16 of each other, the policy on the GPU over NCCL."""
    require_backend(backend)
    proc = run_train(tmp_path, f"policy.backend={backend}", *ONE_GPU_RUN, config="configs/grpo_tiny_cpu.yaml",
                     timeout=900)
    assert_policy_ran_on_gpu(proc.stderr, backend)
    train = read_metrics(f"{tmp_path}/logs", "train")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    for r in train:
        assert math.isfinite(r["reward"]) and 0.0 <= r["reward"] <= 1.0, r
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert 1.0 <= r["token_mult_prob_error"] < MAX_TOKEN_MULT_PROB_ERROR, r
    print(f"{backend}: reward {[round(r['reward'], 3) for r in train]}, token_mult_prob_error "
          f"max {max(r['token_mult_prob_error'] for r in train):.4f}")
    val = read_metrics(f"{tmp_path}/logs", "val")
    assert len(val) == 2 and all(0.0 <= r["accuracy"] <= 1.0 for r in val), val
    assert (tmp_path / "ckpt" / f"step_{STEPS}").is_dir()  # a bf16 checkpoint written from the GPU


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_policy_matches_fp32_hf(ray_cluster, tiny_model_dir, backend):
    """On one GPU in bf16: log-probs close to fp32 Hugging Face on the CPU (and not equal: bf16 is really on),
    fp32 master weights, and one step close to the fp32 reference step (policy_checks.check_bf16_step)."""
    require_backend(backend)
    path = tiny_model_dir("qwen2")
    with Policy(policy_config(path, backend=backend, precision="bfloat16"), ONE_GPU, path) as policy:
        assert (policy.devices, policy.dist_backend) == (["cuda:0"], "nccl")
        check_bf16_step(policy, path, make_batch(4, seed=9))


@pytest.mark.parametrize("backend,distopt", [*((b, False) for b in BACKENDS), ("megatron", True)],
                         ids=[*BACKENDS, "megatron_distopt"])
def test_bf16_moe_policy_matches_fp32_hf(ray_cluster, tiny_model_dir, backend, distopt):
    """Qwen3-MoE (the tiny one: 8 experts, top-2) on one GPU in bf16 (Megatron: its MoELayer, the alltoall
    dispatcher over a group of one; also with the distributed optimizer's dense and expert optimizers): log-probs
    close to fp32 HF, fp32 master weights, one step close to the fp32 reference step."""
    require_backend(backend)
    path = tiny_model_dir("qwen3_moe")
    extra = {"megatron_cfg.use_distributed_optimizer": True} if distopt else {}
    with Policy(policy_config(path, backend=backend, precision="bfloat16", **extra), ONE_GPU, path) as policy:
        assert (policy.devices, policy.dist_backend) == (["cuda:0"], "nccl")
        check_bf16_step(policy, path, make_batch(4, seed=9))


# a packed row of 8 sequences of SmolLM2-like answer lengths, plus its padding tail
SEGMENT_LENGTHS = [137, 593, 293, 1, 211, 450, 64, 300]


@pytest.mark.parametrize("heads,groups,dim", [(9, 3, 64), (4, 4, 128)], ids=["smollm2_gqa", "mha_128"])
def test_varlen_kernel_matches_per_segment_sdpa(heads, groups, dim):
    """On CUDA in bf16 packed_attention runs one varlen kernel over the row (flash-attention's, else torch's own),
    and its output and gradients are as close to fp32 attention through the dense block-diagonal mask as bf16
    SDPA run per segment is (within 2x its error, + 1e-3)."""
    torch.manual_seed(0)
    batch = {"input_ids": torch.zeros(len(SEGMENT_LENGTHS), max(SEGMENT_LENGTHS), dtype=torch.long),
             "input_lengths": torch.tensor(SEGMENT_LENGTHS)}
    segs, dense = model_inputs(batch, True, 64), model_inputs(batch, True, 64, dense_mask=True)
    s, scale = segs.input_ids.shape[1], dim ** -0.5
    q, k, v = (torch.randn(1, h, s, dim, device="cuda") for h in (heads, groups, groups))
    g = torch.randn(1, heads, s, dim, device="cuda")

    def run(fn, dtype, **kw):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*x, scale=scale, **kw)
        return [out.float(), *(t.float() for t in torch.autograd.grad((out * g.to(dtype)).sum(), x))]

    calls = dict(CALLS)
    varlen = run(packed_attention, torch.bfloat16, cu_seqlens=segs.cu_seqlens)
    kernel = [name for name in CALLS if CALLS[name] != calls.get(name, 0)]
    assert kernel in (["flash_varlen"], ["torch_varlen"]), dict(CALLS)
    segments = run(sdpa_per_segment, torch.bfloat16, cu_seqlens=segs.cu_seqlens)
    mask = dense.attention_mask.to("cuda")
    ref = run(lambda *x, scale: torch.nn.functional.scaled_dot_product_attention(
        *x, attn_mask=mask, scale=scale, enable_gqa=heads != groups), torch.float32)
    for name, a, b, r in zip(["out", "dq", "dk", "dv"], varlen, segments, ref):
        err, err_sdpa = (a - r).abs().max().item(), (b - r).abs().max().item()
        print(f"{kernel[0]} {heads}/{groups}x{dim} {name}: {err:.2e} (bf16 SDPA per segment {err_sdpa:.2e})")
        assert err <= 2 * err_sdpa + 1e-3, (name, err, err_sdpa)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_packed_policy_matches_fp32_hf(ray_cluster, tiny_model_dir, backend):
    """Sequence packing on one GPU in bf16: the packed rows go through the varlen kernel (never per-segment SDPA)
    and the policy passes check_bf16_step against fp32 Hugging Face on the padded rows."""
    require_backend(backend)
    path = tiny_model_dir("llama")
    with Policy(policy_config(path, backend=backend, precision="bfloat16", **PACKING), ONE_GPU, path) as policy:
        check_bf16_step(policy, path, make_batch(4, seed=19, t=12))  # lengths 12 3 5 5: bins [12 5 3] [5]
        [kernels] = packed_attention_kernels(policy)
    print(f"{backend}: packed attention calls {kernels}")
    assert "sdpa_segments" not in kernels and kernels.get("torch_varlen", 0) + kernels.get("flash_varlen", 0) > 0
