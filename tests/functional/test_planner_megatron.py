"""The planner against Megatron-Core models built on the meta device, each in a subprocess with a fake process
group (Megatron's parallel state is global): parameter counts per pipeline stage at the 8B / 70B recipes' layouts,
and activation bytes per layer against what autograd saves. The rest of the planner: tests/unit/test_planner.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from nemo_grpo.backends import activations as act
from nemo_grpo.backends.mcore.memory import megatron_stage_params
from nemo_grpo.planning.params import decoder_spec, hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)


MEGATRON_META = r"""
import json, sys, torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
name, tp, pp, head = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * pp)
from types import SimpleNamespace
from megatron.core import parallel_state as ps
from nemo_grpo.backends.mcore import model as mmodel, shim
from nemo_grpo.planning.params import decoder_spec, hf_config
shim.apply(); shim.allow_sequence_parallel_norm()
with shim.device_context():
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=False)
spec = decoder_spec(hf_config(name, "x"), head, tp, pp)
layout = SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=True,
                         activation_checkpointing=False)
counts = []
for stage in range(pp):
    ps.set_pipeline_model_parallel_rank(stage)
    with torch.device("meta"), shim.device_context():
        model = mmodel.build_gpt(spec, mmodel.transformer_config(spec, layout, torch.bfloat16))
    counts.append(sum(p.numel() for p in model.parameters()))
print(json.dumps(counts))
"""


@pytest.mark.parametrize("name,tp,pp,head", [("Llama-3.1-8B-Instruct", 2, 1, False),  # grpo_math_8B_megatron
                                             ("Llama-3.3-70B-Instruct", 8, 2, False),  # grpo_math_70B_megatron
                                             ("Llama-3.1-70B-Reward-BT", 8, 2, True)])  # grpo_rm_70B_megatron's RM
def test_megatron_meta_model_has_the_planned_parameters(name, tp, pp, head):
    """Megatron-Core GPTModel chunks built on the meta device at world size tp x pp (a fake process group),
    one per pipeline stage: each has the planner's per-rank count."""
    proc = subprocess.run([sys.executable, "-c", MEGATRON_META, f"/nonexistent/{name}", str(tp), str(pp),
                           "1" if head else "0"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    spec = decoder_spec(hf_config(f"/nonexistent/{name}", "x"), head, tp, pp)
    assert counts == [megatron_stage_params(spec, tp, pp, s) for s in range(pp)]


MEGATRON_ACTIVATIONS = r"""
import json, torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig
torch.set_num_threads(1)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
from types import SimpleNamespace
from megatron.core import parallel_state as ps, tensor_parallel
from nemo_grpo.backends.mcore import model as mmodel, shim
from nemo_grpo.models.spec import model_spec
shim.apply()
with shim.device_context():
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
layout = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
                         activation_checkpointing=False)
small, attention = json.loads(__import__("sys").argv[1]), __import__("sys").argv[2]
out = {}
for dtype in (torch.float32, torch.bfloat16):
    for layers in (1, 2):
        spec = model_spec(LlamaConfig(**dict(small, num_hidden_layers=layers), architectures=["LlamaForCausalLM"]))
        with shim.device_context():
            model = mmodel.build_gpt(spec, mmodel.transformer_config(spec, layout, dtype), attention)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
            params = {p.untyped_storage().data_ptr() for p in model.parameters()}
            seen = {}
            def pack(t):
                if t.untyped_storage().data_ptr() not in params:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            ids = torch.randint(0, 1000, (2, 64))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(input_ids=ids, position_ids=torch.arange(64)[None].expand(2, 64), attention_mask=None)
        out[f"{dtype}-{layers}"] = sum(seen.values())
print(json.dumps(out))
"""


@pytest.mark.parametrize("attention,impl", [("unfused", "megatron"), ("sdpa", "megatron_sdpa")])
def test_megatron_layer_activations_match_autograd(attention, impl):
    """The Megatron-Core local layer spec (the CPU-measurable one) with either core attention, fp32 and bf16, TP 1."""
    proc = subprocess.run([sys.executable, "-c", MEGATRON_ACTIVATIONS, json.dumps(SMALL), attention],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads(proc.stdout.strip().splitlines()[-1])
    spec = decoder_spec(LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"]), False)
    for dtype, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
        per_layer = saved[f"{dtype}-2"] - saved[f"{dtype}-1"]
        planned = act.layer_bytes_per_token(spec, impl, nbytes, 64, seqs_per_micro_batch=2) * 2 * 64
        print(f"{attention} {dtype}: saved {per_layer} bytes per layer, planned {planned:.0f}")
        assert per_layer == pytest.approx(planned, rel=0.01), dtype
