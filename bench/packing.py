"""Padding waste and real tokens per second: padded micro-batches, dynamic batching and sequence packing, on
SmolLM2-135M-Instruct and the lengths of its own sampled answers to math word problems.

    python bench/packing.py                       # 32 answers of at most 512 tokens, DTensor DP=2 (~13 min)
    python bench/packing.py --samples 16 --max-new-tokens 256
    python bench/packing.py --precision bfloat16  # bf16 mixed precision (fp32 master weights), as the SmolLM2 recipe
    python bench/packing.py --kernels [--device cuda]   # the attention kernels alone on one packed row (~10 s)

1. The engine (vLLM where installed, else torch) samples one answer per problem at temperature 1.0; the
   conversations (prompt + answer) are the batch, right-padded; the length distribution is printed.
2. Per mode, a fresh policy (DTensor, 2 ranks x 1 thread) runs one warm-up forward, then get_logprobs over the
   batch and one train step (the batch is one global batch; nemo_grpo's clipped PG loss, advantages +-1):
   - padded:  fixed micro-batches (train_micro_batch_size=4, logprob_batch_size=8 per rank), each padded to
              its longest row;
   - dynamic: policy.dynamic_batching, rows sorted by length and cut under the token budgets;
   - packed:  policy.sequence_packing, first-fit-decreasing bins of at most the token budgets' real tokens.
   The budgets are what the padded micro-batches may hold at worst: 4 (train) and 8 (log-probs) rows x the
   longest conversation.
3. Tokens computed = sum over the micro-batches of rows x width, from the same plan the policy runs (DTensor:
   a padded micro-batch is as wide as its longest row, a packed row as its tokens rounded up to 64), divided
   by the real tokens; real tokens per second = real tokens / seconds. Ratios against padded.

--kernels: no model; one packed row of KERNEL_ROW's sequences (2,900 tokens, SmolLM2's answer lengths;
--row-repeat N: N times over) with SmolLM2's heads (9 query, 3 KV, 64 wide), forward + backward of causal
attention through each kernel backends/varlen.py has on the device: the dense block-diagonal mask (one SDPA call
over the row), SDPA per segment, and the one-kernel varlen path (CUDA: flash-attention's, else torch's
`varlen_attn`), in fp32 and bf16: the median of --repeats timed calls after 3 warm-ups, and the ratio to the
dense mask.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from timing import median_seconds, machine_line  # noqa: E402  (bench/timing.py)

MODES = ("padded", "dynamic", "packed")
KERNEL_ROW = [137, 593, 293, 211, 450, 64, 300, 380, 250, 222]  # 2,900 tokens in 10 sequences
TRAIN_ROWS, LOGPROB_ROWS, ROUND = 4, 8, 64


def word_problems(n: int, seed: int) -> list[str]:
    """n two- or three-step arithmetic word problems (a math prompt set that needs no download)."""
    rng = random.Random(seed)
    people, things = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid"], ["apples", "stickers", "marbles", "books"]
    out = []
    for _ in range(n):
        who, what = rng.choice(people), rng.choice(things)
        a, b, c, d = (rng.randint(2, 60) for _ in range(4))
        out.append(rng.choice([
            f"{who} has {a} {what}. She buys {b} more and gives {c} to a friend. How many {what} does she have now?",
            f"A shop sells {what} in boxes of {a}. {who} buys {b} boxes and {c} loose {what}. How many {what} "
            f"is that in total?",
            f"{who} reads {a} pages a day for {b} days, then {c} pages a day for {d} days. How many pages in all?",
        ]) + " Think step by step, then give the final answer as \\boxed{number}.")
    return out


def sample_conversations(path: str, n: int, max_new_tokens: int, seed: int) -> tuple[list[list[int]], list[int],
                                                                                     int]:
    """(prompt + answer token ids per problem, answer lengths, answers cut at max_new_tokens), one sample each."""
    from nemo_grpo.models.tokenizer import load_tokenizer

    from nemo_grpo.config import ClusterConfig, GenerationConfig
    from nemo_grpo.data.prompts import render_prompt
    from nemo_grpo.generation import make_generation_engine

    tokenizer = load_tokenizer(path)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in word_problems(n, seed)]
    gen = GenerationConfig(backend="vllm", max_new_tokens=max_new_tokens, temperature=1.0)
    engine = make_generation_engine(gen, path, ClusterConfig(gpus_per_node=2, num_nodes=1,
                                                             num_threads_per_worker=2))
    try:
        outs = engine.generate(prompts, seed=seed)
    finally:
        engine.shutdown()
    return ([list(p) + list(o.token_ids) for p, o in zip(prompts, outs)], [len(o.token_ids) for o in outs],
            sum(o.finish_reason == "length" for o in outs))


def make_batch(rows: list[list[int]], prompt_lengths: list[int], pad_id: int) -> dict:
    """Right-padded training batch; the loss covers the answers, advantages +-1 per conversation."""
    n, t = len(rows), max(map(len, rows))
    ids = torch.full((n, t), pad_id)
    token_mask = torch.zeros(n, t)
    for i, (row, start) in enumerate(zip(rows, prompt_lengths)):
        ids[i, : len(row)] = torch.tensor(row)
        token_mask[i, start : len(row)] = 1.0
    sign = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
    return {"input_ids": ids, "input_lengths": torch.tensor(list(map(len, rows))), "token_mask": token_mask,
            "sample_mask": torch.ones(n), "advantages": sign[:, None] * token_mask,
            "prev_logprobs": torch.zeros(n, t), "generation_logprobs": torch.zeros(n, t)}


def policy_config(path: str, mode: str, n: int, longest: int, precision: str):
    from nemo_grpo.config import PolicyConfig

    cfg = PolicyConfig(model_name=path, backend="dtensor", precision=precision, train_global_batch_size=n,
                       train_micro_batch_size=TRAIN_ROWS, logprob_batch_size=LOGPROB_ROWS,
                       max_total_sequence_length=longest)
    section = {"dynamic": cfg.dynamic_batching, "packed": cfg.sequence_packing}.get(mode)
    if section is not None:
        section.enabled = True
        section.train_mb_tokens, section.logprob_mb_tokens = TRAIN_ROWS * longest, LOGPROB_ROWS * longest
        section.sequence_length_round = ROUND if mode == "packed" else 1
    return cfg


def computed_tokens(policy, batch: dict, kind: str) -> int:
    """Rows x width summed over the micro-batches the policy plans for `batch` (DTensor's widths)."""
    from nemo_grpo.backends.batching import take_rows
    from nemo_grpo.backends.model_inputs import natural_width
    from nemo_grpo.policy import dp_row_order

    cfg, lengths = policy.cfg, batch["input_lengths"]
    order = dp_row_order(len(lengths), policy.dp_size, cfg.train_global_batch_size)
    shards = [{"input_lengths": lengths[rows[rows >= 0]], "input_ids": lengths[rows[rows >= 0]]} for rows in order]
    plan = policy._micro_batch_plan([s["input_lengths"].tolist() for s in shards], kind)
    packed, total = cfg.sequence_packing.enabled, 0
    for shard, groups in zip(shards, plan):
        for g in groups:
            mb = take_rows(shard, g)
            total += natural_width(mb, packed, ROUND if packed else 1) * (1 if packed else len(g))
    return total


def run_mode(path: str, mode: str, batch: dict, precision: str) -> dict:
    from nemo_grpo.algorithms.losses import make_loss
    from nemo_grpo.config import ClusterConfig, LossConfig
    from nemo_grpo.policy import Policy

    n, real = len(batch["input_lengths"]), int(batch["input_lengths"].sum())
    cfg = policy_config(path, mode, n, int(batch["input_lengths"].max()), precision)
    cluster = ClusterConfig(gpus_per_node=2, num_nodes=1, num_threads_per_worker=1)
    with Policy(cfg, cluster, path) as policy:
        policy.get_logprobs({k: batch[k][:4] for k in ("input_ids", "input_lengths")})  # warm-up
        t0 = time.perf_counter()
        policy.get_logprobs(batch)
        t1 = time.perf_counter()
        policy.train(batch, make_loss(LossConfig().name, LossConfig()))
        t2 = time.perf_counter()
        return {"logprob_s": t1 - t0, "train_s": t2 - t1, "real": real,
                "logprob_waste": computed_tokens(policy, batch, "logprob") / real,
                "train_waste": computed_tokens(policy, batch, "train") / real}


def kernel_table(device: str, repeats: int, row_repeat: int) -> None:
    """Print forward + backward ms per kernel on one packed row of KERNEL_ROW x row_repeat (module docstring)."""
    import torch.nn.functional as F

    from nemo_grpo.backends import varlen
    from nemo_grpo.backends.model_inputs import model_inputs

    lengths = KERNEL_ROW * row_repeat
    batch = {"input_ids": torch.zeros(len(lengths), max(lengths), dtype=torch.long),
             "input_lengths": torch.tensor(lengths)}
    segs, dense = model_inputs(batch, True, ROUND), model_inputs(batch, True, ROUND, dense_mask=True)
    s, mask = segs.input_ids.shape[1], dense.attention_mask.to(device)
    kernels = {"dense mask": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
               "SDPA per segment": lambda q, k, v: varlen.sdpa_per_segment(q, k, v, segs.cu_seqlens, 64 ** -0.5),
               "varlen kernel": lambda q, k, v: varlen.packed_attention(q, k, v, segs.cu_seqlens, 64 ** -0.5)}
    print(f"\none packed row: {len(lengths)} sequences, {sum(lengths)} tokens ({s} with the tail), 9 heads "
          f"/ 3 KV of 64, forward + backward on {device}")
    print("| kernel | dtype | ran | ms | vs dense mask |\n|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(1, h, s, 64, device=device, dtype=dtype, requires_grad=True) for h in (9, 3, 3))
        base = None
        for name, fn in kernels.items():
            before = dict(varlen.CALLS)
            try:
                ms = _median_ms(lambda: fn(q, k, v).sum().backward(), device, repeats)
            except torch.OutOfMemoryError:  # the dense mask at tens of thousands of tokens
                q.grad = k.grad = v.grad = None
                torch.cuda.empty_cache()
                print(f"| {name} | {str(dtype)[6:]} | | out of memory | |")
                continue
            ran = ", ".join(n for n in varlen.CALLS if varlen.CALLS[n] != before.get(n, 0)) or "SDPA"
            if name == "dense mask":
                base = ms
            ratio = f"{base / ms:.2f}x" if base else "-"
            print(f"| {name} | {str(dtype)[6:]} | {ran} | {ms:.2f} | {ratio} |")


def _median_ms(call, device: str, repeats: int, warmup: int = 3) -> float:
    """median_seconds of call() in ms after `warmup` calls, each call waited for on a GPU."""
    def synced():
        call()
        if device == "cuda":
            torch.cuda.synchronize()
    for _ in range(warmup):
        synced()
    return 1e3 * median_seconds(synced, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=["float32", "bfloat16"], default="float32", help="policy.precision")
    ap.add_argument("--kernels", action="store_true", help="time the packed-attention kernels alone (no model)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="--kernels: where they run")
    ap.add_argument("--repeats", type=int, default=10, help="--kernels: timed calls per kernel")
    ap.add_argument("--row-repeat", type=int, nargs="+", default=[1],
                    help="--kernels: rows of KERNEL_ROW's sequences this many times over (one table each)")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    torch.set_num_threads(1)
    if args.kernels:
        for n in args.row_repeat:
            kernel_table(args.device, args.repeats, n)
        return
    from nemo_grpo.models.tokenizer import load_tokenizer

    from nemo_grpo.distributed.cluster import init_ray
    from nemo_grpo.models.builtin import resolve_model_path

    path = resolve_model_path("builtin:smollm2-135m-instruct")
    init_ray()
    rows, answers, cut = sample_conversations(path, args.samples, args.max_new_tokens, args.seed)
    prompt_lengths = [len(r) - a for r, a in zip(rows, answers)]
    totals = [len(r) for r in rows]
    for name, values in (("answer", answers), ("conversation", totals)):
        print(f"{name} tokens over {len(values)} samples: min {min(values)}, median {statistics.median(values):g}, "
              f"max {max(values)}, mean {statistics.mean(values):.1f}")
    print(f"answers that reached --max-new-tokens {args.max_new_tokens}: {cut}; the others stopped at EOS")
    batch = make_batch(rows, prompt_lengths, load_tokenizer(path).pad_token_id)
    results = {mode: run_mode(path, mode, batch, args.precision) for mode in MODES}
    base = results["padded"]
    print(f"\nreal tokens: {base['real']}; DTensor DP=2, 1 thread per rank, {args.precision}; ratios against padded")
    print("| mode | log-probs: computed / real | s | real tok/s | vs padded | train: computed / real | s | "
          "real tok/s | vs padded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        lp_rate, tr_rate = r["real"] / r["logprob_s"], r["real"] / r["train_s"]
        print(f"| {mode} | {r['logprob_waste']:.2f}x | {r['logprob_s']:.1f} | {lp_rate:.0f} | "
              f"{base['logprob_s'] / r['logprob_s']:.2f}x | {r['train_waste']:.2f}x | {r['train_s']:.1f} | "
              f"{tr_rate:.0f} | {base['train_s'] / r['train_s']:.2f}x |")


if __name__ == "__main__":
    main()
