"""Hidden tests of notebook 04's exercises: mixed precision reaches every unit, other shapes, weight decay."""
from labkit.course.exercises import case, spawn

#: LEGACY: these exercises' tests still run in the student's process; port them to `student.call /
#: run / spawn` (docs/grading.md, "Porting a legacy exercise") and remove their names here.
LEGACY = {"shard_model", "zero1_step"}

MUTANTS = {
    "shard_model": [
        ("fully_shard(block, mesh=mesh, mp_policy=mp_policy)", "block"),  # no per-block units
        ("fully_shard(block, mesh=mesh, mp_policy=mp_policy)", "fully_shard(block, mesh=mesh)"),
        ("fully_shard(model, mesh=mesh, mp_policy=mp_policy)", "fully_shard(model, mesh=mesh)"),
    ],
    "zero1_step": [
        ("lo, hi = rank * size, (rank + 1) * size", "lo, hi = 0, size"),
        ("dist.all_reduce(grads, group=group)", "grads"),
        ("lr=lr, weight_decay=weight_decay)", "lr=lr)"),
    ],
}


def _three_block_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    import torch

    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _bf16_rank(rank, world, shard_model):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world,))
    model = shard_model(_three_block_llama(), mesh,
                        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    seen = {}

    def probe(name):
        def hook(module, args, output):
            seen[name] = str(module.weight.dtype)
        return hook

    for i, block in enumerate(model.model.layers):
        block.self_attn.q_proj.register_forward_hook(probe(f"layers.{i}.q_proj"))
    model.lm_head.register_forward_hook(probe("lm_head"))
    tokens = torch.arange(2 * 9).reshape(2, 9) % 96
    model(tokens).logits.float().mean().backward()
    return {"compute": seen,
            "masters": sorted({str(p.dtype) for p in model.parameters()}),
            "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "units": [isinstance(b, FSDPModule) for b in model.model.layers] + [isinstance(model, FSDPModule)]}


@case("shard_model", points=2)
def bf16_policy_on_every_unit_masters_fp32(shard_model):
    out = spawn(_bf16_rank, world=2, args=(shard_model,), timeout=180)[0]
    assert all(out["units"]), f"FSDP units (3 blocks, root): {out['units']}"
    assert out["all_dtensor"], "some parameters are not sharded"
    assert out["masters"] == ["torch.float32"], f"sharded master weights must stay fp32: {out['masters']}"
    wrong = {k: v for k, v in out["compute"].items() if v != "torch.bfloat16"}
    assert not wrong, f"these layers computed with non-bf16 weights under a bf16 policy: {wrong}"


@case("zero1_step", points=2)
def weight_decay_and_more_steps(zero1_step):
    from labkit.course.exercises.handmade import zero1_vs_adamw

    for rank, out in enumerate(spawn(zero1_vs_adamw, world=2, args=(zero1_step, 5, 0.1), timeout=120)):
        err = float((out["sharded"] - out["ref"]).abs().max())
        assert err < 1e-5, f"rank {rank}: 5 steps with weight decay 0.1 differ from AdamW by {err:.2e}"
