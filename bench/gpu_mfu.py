"""Training throughput and MFU of a ~1.2B-parameter Llama on one GPU: DTensor vs Megatron, bf16, world size 1.

    python bench/gpu_mfu.py                          # both back ends, 8 x 2048 tokens per step, micro-batch 1
    python bench/gpu_mfu.py --micro 2 --repeats 10 --only dtensor
    python bench/gpu_mfu.py --device cpu --tiny      # smoke run of this script on a CPU (a tiny Llama, ~30 s)
    python bench/gpu_mfu.py --moe                    # a Qwen3-MoE (Qwen3-30B-A3B's layer, 4 layers, 64 experts)
    python bench/gpu_mfu.py --moe --only dtensor megatron megatron_loop   # Megatron's experts grouped vs looped
    python bench/gpu_mfu.py --packing                # rows of mixed lengths: padded vs sequence packing

The model: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, FFN 8192, vocabulary
128256, tied embeddings), random weights, saved once as a Hugging Face directory that both back ends load.
Per back end: a Policy of one worker in bf16 (fp32 master weights, AdamW, gradient clipping), and
`Policy.train` over one global batch of --batch full sequences of --seq-len tokens in micro-batches of
--micro = one optimizer step; the figure is the median wall time of --repeats calls after --warmup, measured
at the driver (Ray dispatch and the metrics' return included: a few ms).
MFU = model FLOPs per step / step seconds / peak, model FLOPs = 6 N T + 12 L H S T (PaLM, appendix B): N the
parameters, T the tokens of a step, L layers, H hidden size, S the sequence length. The attention term counts
the whole S x S score matrix (causal kernels compute half) and activation recomputation is not counted.
Peak: H100 SXM bf16 dense, 989 TFLOP/s (the H200 the same); --peak-tflops for another device.
--moe: a Qwen3-MoE with Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, experts of FFN 768, top-8
renormalised, vocabulary 151936, untied) but 4 layers of 64 experts instead of 48 of 128 (~1.7B parameters: its fp32
masters and Adam state fit one GPU); N in the MFU is then the parameters a token computes with (8 experts a layer).
Megatron runs its MoELayer (its SequentialMLP's experts computed by two torch grouped matmuls a layer,
backends/mcore/grouped_experts.py; alltoall dispatcher over a group of one), DTensor HF's module; megatron_loop
is Megatron with policy.megatron_cfg.moe_grouped_gemm=false (SequentialMLP's loop over the experts).
--packing: the rows' lengths are uniform in [--seq-len / 8, --seq-len] (seed 0), as a rollout batch's are, and each
back end trains them padded (micro-batches of --micro rows) and with policy.sequence_packing (bins of --micro x
--seq-len real tokens; attention per sequence, backends/varlen.py: torch's varlen kernel on a GPU); the table gives
real (unpadded) tokens per second and packed / padded.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
from policy_layouts import make_batch, time_train_steps  # noqa: E402  (bench/policy_layouts.py)

BACKENDS = ("dtensor", "megatron")
VARIANTS = (*BACKENDS, "megatron_loop")  # megatron_loop: Megatron's experts in SequentialMLP's loop
H100_BF16_DENSE_TFLOPS = 989.0
# Hugging Face LlamaConfig fields (tie_word_embeddings: True, from nemo_grpo.models.tiny.tiny_config)
LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                head_dim=64, intermediate_size=8192, vocab_size=128256)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=256, vocab_size=512)
# Hugging Face Qwen3MoeConfig fields: Qwen3-30B-A3B's layer, 4 of its 48 layers, 64 of its 128 experts
QWEN3_MOE = dict(arch="qwen3_moe", hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, intermediate_size=6144, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=768, vocab_size=151936, tie_word_embeddings=False)
TINY_MOE = dict(arch="qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                vocab_size=512)
# model and the defaults of --batch, --seq-len, --micro, --warmup, --repeats
PRESETS = {"llama": dict(model=LLAMA_1B, batch=8, seq_len=2048, micro=1, warmup=2, repeats=5),
           "tiny-llama": dict(model=TINY, batch=4, seq_len=64, micro=2, warmup=1, repeats=2),
           "moe": dict(model=QWEN3_MOE, batch=8, seq_len=2048, micro=1, warmup=2, repeats=5),
           "tiny-moe": dict(model=TINY_MOE, batch=4, seq_len=64, micro=2, warmup=1, repeats=2)}


def save_model(path: str, shape: dict, seq_len: int) -> str:
    """A random-weight model of `shape` (a Llama unless shape names its arch; + the tiny character tokenizer)
    saved as a HF directory at path."""
    from nemo_grpo.models.tiny import save_tiny_model

    shape = dict(shape)
    return save_tiny_model(path, arch=shape.pop("arch", "llama"), max_position_embeddings=max(seq_len, 128),
                           **shape)


def mixed_length_batch(n: int, seq_len: int, vocab: int) -> dict:
    """n rows of random tokens, lengths uniform in [seq_len / 8, seq_len] (seed 0), right-padded to seq_len."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(seq_len // 8, seq_len + 1, (n,), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).float()
    return {"input_ids": torch.randint(3, vocab, (n, seq_len), generator=g), "input_lengths": lengths,
            "token_mask": mask, "sample_mask": torch.ones(n)}


def count_parameters(model_dir: str) -> tuple[int, int]:
    """(all, active) parameters of a saved HF model (tied embeddings once), as the memory planner counts them;
    active: those one token computes with (an MoE's routed experts only; all of a dense model)."""
    from nemo_grpo.models.counts import active_params, total_params
    from nemo_grpo.planning.params import decoder_spec, hf_config

    spec = decoder_spec(hf_config(model_dir, "--model-dir"), scalar_head=False, any_rope=True)
    return total_params(spec), active_params(spec)


def model_flops_per_step(n_params: int, shape: dict, seq_len: int, tokens: int) -> float:
    """6 N T (matmuls, forward + backward) + 12 L H S T (attention scores and values, forward + backward)."""
    return 6.0 * n_params * tokens + 12.0 * shape["num_hidden_layers"] * shape["hidden_size"] * seq_len * tokens


def policy_config(variant: str, path: str, args):
    """bf16 PolicyConfig: one global batch of args.batch rows in micro-batches of args.micro."""
    from nemo_grpo.config import PolicyConfig

    backend = variant.partition("_")[0]
    cfg = PolicyConfig(model_name=path, backend=backend, precision="bfloat16", train_global_batch_size=args.batch,
                       train_micro_batch_size=args.micro, logprob_batch_size=args.micro,
                       max_total_sequence_length=args.seq_len)
    cfg.dtensor_cfg.activation_checkpointing = args.activation_checkpointing
    cfg.megatron_cfg.activation_checkpointing = args.activation_checkpointing
    cfg.megatron_cfg.layer_spec = args.megatron_layer_spec
    cfg.megatron_cfg.moe_grouped_gemm = not variant.startswith("megatron_loop")  # also megatron_loop_packed
    if variant.endswith("_packed"):
        packing = cfg.sequence_packing
        packing.enabled, packing.sequence_length_round = True, 64
        packing.train_mb_tokens = packing.logprob_mb_tokens = args.micro * args.seq_len
    return cfg


def time_backend(backend: str, path: str, batch: dict, args) -> dict:
    """{"seconds", "devices", "dist_backend"} of one back end, or {"error": why} (missing package, OOM...)."""
    from nemo_grpo.config import ClusterConfig

    if backend.startswith("megatron") and importlib.util.find_spec("megatron") is None:
        return {"error": "megatron-core is not installed"}
    cluster = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=args.threads)
    try:
        result = time_train_steps(policy_config(backend, path, args), cluster, path, batch, args.repeats,
                                  args.warmup)
    except Exception as e:  # a Ray task error wraps the worker's traceback: its last line says what failed
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        return {"error": lines[-1][:300] if lines else type(e).__name__}
    if not all(d.startswith(args.device) for d in result["devices"]):
        raise RuntimeError(f"{backend}: asked for --device {args.device}, the worker ran on {result['devices']}")
    return result


def derived(result: dict, flops: float, tokens: int, peak_tflops: float) -> dict:
    """s/step, tokens/s, TFLOP/s and MFU (fraction of peak) of a timed back end."""
    s = result["seconds"]
    return {"s/step": s, "tokens/s": tokens / s, "TFLOP/s": flops / s / 1e12,
            "MFU": flops / s / (peak_tflops * 1e12)}


def describe(shape: dict, n_params: int, n_active: int) -> str:
    """One line: the model's kind, parameters and shape."""
    heads = (f"{shape['hidden_size']}, {shape['num_hidden_layers']} layers, {shape['num_attention_heads']}/"
             f"{shape['num_key_value_heads']} heads of {shape['head_dim']}")
    if shape.get("arch") == "qwen3_moe":
        return (f"Qwen3-MoE {n_params:,} parameters, {n_active:,} active (hidden {heads}, {shape['num_experts']} "
                f"experts of FFN {shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']}, vocab "
                f"{shape['vocab_size']})")
    return f"Llama {n_params:,} parameters (hidden {heads}, FFN {shape['intermediate_size']}, vocab " \
           f"{shape['vocab_size']}, tied)"


def print_packing_table(rows: dict, args, batch: dict) -> None:
    """--packing: seconds per step and real tokens per second of each back end padded and packed."""
    real = int(batch["input_lengths"].sum())
    print(f"\n{args.batch} rows of {int(batch['input_lengths'].min())}-{args.seq_len} tokens ({real} real, "
          f"{real / (args.batch * args.seq_len):.0%} of the padded size), micro-batch {args.micro} rows or "
          f"{args.micro * args.seq_len} packed tokens; median of {args.repeats} after {args.warmup} warm-up")
    print("| variant | s/step | real tokens/s | packed / padded |\n|---|---|---|---|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | failed: {r['error']} | | |")
            continue
        padded = rows.get(name.removesuffix("_packed"), {})
        ratio = f"{padded['seconds'] / r['seconds']:.2f}x" if name.endswith("_packed") and "seconds" in padded else ""
        print(f"| {name} | {r['seconds']:.3f} | {real / r['seconds']:.0f} | {ratio} |")


def print_table(rows: dict, args, n_params: tuple[int, int], shape: dict) -> None:
    """Metrics by row, back ends side by side, then megatron / dtensor where both ran. n_params: (all, active)."""
    ok = {b: r for b, r in rows.items() if "error" not in r}
    devices = sorted({d for r in ok.values() for d in r["devices"]}) or ["-"]
    print(f"\n{describe(shape, *n_params)}, bf16 on {', '.join(devices)}; "
          f"{args.batch} x {args.seq_len} tokens per step, micro-batch {args.micro}"
          f"{', activation recomputation' if args.activation_checkpointing else ''}; "
          f"median of {args.repeats} after {args.warmup} warm-up; peak {args.peak_tflops:g} TFLOP/s")
    flops = model_flops_per_step(n_params[1], shape, args.seq_len, args.batch * args.seq_len)
    stats = {b: derived(r, flops, args.batch * args.seq_len, args.peak_tflops) for b, r in ok.items()}
    names = list(rows)
    both = all(b in stats for b in BACKENDS)
    print(f"{'':10s}" + "".join(f"{b:>15s}" for b in names) + (f"{'megatron/dtensor':>18s}" if both else ""))
    for metric, fmt in (("s/step", "{:15.3f}"), ("tokens/s", "{:15.0f}"), ("TFLOP/s", "{:15.1f}"),
                        ("MFU", "{:15.1%}")):
        cells = "".join(fmt.format(stats[b][metric]) if b in stats else f"{'failed':>15s}" for b in names)
        ratio = f"{stats['megatron'][metric] / stats['dtensor'][metric]:17.2f}x" if both else ""
        print(f"{metric:10s}{cells}{ratio}")
    for b, r in rows.items():
        if "error" in r:
            print(f"{b}: {r['error']}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=VARIANTS, default=list(BACKENDS))
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and batch (a smoke run, e.g. on a CPU)")
    ap.add_argument("--moe", action="store_true", help="a Qwen3-MoE (Qwen3-30B-A3B's layer) instead of the Llama")
    ap.add_argument("--batch", type=int, help="sequences per step (default 8; --tiny 4)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; --tiny 64)")
    ap.add_argument("--micro", type=int, help="sequences per forward/backward (default 1; --tiny 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps first (default 2; --tiny 1)")
    ap.add_argument("--repeats", type=int, help="timed steps (default 5; --tiny 2)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute activations (both)")
    ap.add_argument("--megatron-layer-spec", choices=["local", "transformer_engine"], default="local")
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="the device's bf16 peak")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (a CPU run)")
    ap.add_argument("--model-dir", help="keep the saved model here (default: a temporary directory, removed)")
    ap.add_argument("--packing", action="store_true", help="mixed-length rows, padded vs sequence packing")
    args = ap.parse_args()
    preset = PRESETS[("tiny-" if args.tiny else "") + ("moe" if args.moe else "llama")]
    for key in ("batch", "seq_len", "micro", "warmup", "repeats"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    args.shape = preset["model"]
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # Ray (started below) and its workers see no GPU
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: use --device cpu --tiny for a smoke run of the script")
    import ray

    from nemo_grpo.distributed.cluster import init_ray

    workdir = None if args.model_dir else tempfile.TemporaryDirectory(prefix="bench_mfu_")
    path = save_model(args.model_dir or workdir.name, args.shape, args.seq_len)
    n_params = count_parameters(path)
    print(f"model: {n_params[0]:,} parameters ({n_params[1]:,} active) saved to {path}", flush=True)
    init_ray()
    batch = (mixed_length_batch if args.packing else make_batch)(args.batch, args.seq_len, args.shape["vocab_size"])
    variants = [v for b in args.only for v in ((b, f"{b}_packed") if args.packing else (b,))]
    rows = {}
    for variant in variants:
        rows[variant] = time_backend(variant, path, batch, args)
        print(f"  {variant}: " + (rows[variant].get("error") or f"{rows[variant]['seconds']:.3f} s/step"),
              flush=True)
    ray.shutdown()
    if args.packing:
        print_packing_table(rows, args, batch)
    else:
        print_table(rows, args, n_params, args.shape)
    if workdir is not None:
        workdir.cleanup()


if __name__ == "__main__":
    main()
