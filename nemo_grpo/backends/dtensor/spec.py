"""The DTensor back end as the rest of the house sees it: policy.dtensor_cfg, its layout (FSDP2 x tensor parallel,
world = dp x cp x tp, no pipeline), its rules, and its memory model (backends/dtensor/memory.py).

Light to import: the engine (torch.distributed, FSDP2) is imported on first use of `engine_class`.
"""

from __future__ import annotations

from nemo_grpo.backends.registry import BackendSpec
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.models.spec import check_divisible, model_spec


class DTensorSpec(BackendSpec):
    name = "dtensor"
    section = "dtensor_cfg"
    engine = "nemo_grpo.backends.dtensor.engine:DTensorEngine"
    degree_keys = {"tp": "tensor_parallel_size", "cp": "context_parallel_size", "dp": "data_parallel_size"}

    def validate_model(self, p, hf, model_path: str, prefix: str) -> None:
        """Heads, KV heads and MLP width split over tp (HF's own model: any RoPE, any expert count)."""
        check_divisible(hf, self.cfg(p).tensor_parallel_size, 1, self.key(prefix, "tensor_parallel_size"))

    def model_spec(self, p, hf, scalar_head: bool, prefix: str):
        """Any RoPE Hugging Face runs (sized as plain RoPE); tp splits only the layers' linears, checked apart."""
        return model_spec(hf, scalar_head=scalar_head, any_rope=True)

    def plan_devices(self, p, spec, workload, world: int) -> tuple[list, dict[str, float]]:
        from nemo_grpo.backends.dtensor import memory  # here: models.lora imports torch

        return memory.plan_devices(p, spec, workload, world)

    def describe_plan(self, p, layout: ParallelLayout) -> tuple[str, list[str]]:
        cp = f" (DP {layout.dp} x CP {layout.cp})" if layout.cp > 1 else ""
        shape = f"dtensor FSDP {layout.dp * layout.cp}{cp} x TP {layout.tp}"
        return shape, ["recompute"] if self.cfg(p).activation_checkpointing else []

    def moe_notes(self, p, spec, layout: ParallelLayout) -> list[str]:
        return [f"experts: all {spec.experts} per layer on every rank (HF's modules, replicated over TP), sharded "
                f"by FSDP2 like the rest"]


SPEC = DTensorSpec()
