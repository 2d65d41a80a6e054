"""A real client, unchanged on GPUs and on the cpu mesh: a small Llama (transformers, random
weights, no download) with its MLPs swapped for et.nn.TensorParallelMLP; its logits must match
the unsharded model's (bf16 on GPUs, float32 and a smaller model on CPUs).

    torchrun --nproc_per_node=2 tests/cpu_mesh/llama_worker.py      -> 'OK llama' per rank
"""
import os

import torch
import torch.distributed as dist
import transformers

import etdist as et
from etdist.mesh import liveness

liveness.SHM_DIR = os.environ.get("TEST_SHM_DIR")   # the test's own directory, checked empty after


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main():
    gpu = torch.cuda.is_available()
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")
    mesh = et.init_mesh()
    H, I, dtype = (1024, 2816, torch.bfloat16) if gpu else (64, 128, torch.float32)
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                                   max_position_embeddings=512)
    torch.manual_seed(0)  # the same model and tokens on every rank
    model = transformers.LlamaForCausalLM(cfg).to(mesh.device, dtype).eval()
    batches = [torch.randint(0, 1000, shape, device=mesh.device) for shape in ((1, 9), (2, 77))]  # 9, 154 tokens
    with torch.no_grad():
        want = [model(ids).logits.float() for ids in batches]
        ref32 = [model.float()(ids).logits for ids in batches]
        model.to(dtype)
        for layer in model.model.layers:
            layer.mlp = et.nn.TensorParallelMLP.from_dense(layer.mlp, mesh=mesh)
        assert isinstance(model.model.layers[1].mlp, et.nn.TensorParallelMLP)
        for ids, w, r in zip(batches, want, ref32):
            got = model(ids).logits.float()
            # the sharded model is as close to the float32 model as the dense one is (bf16), or exact
            err, dense_err = rel(got, r), rel(w, r)
            assert err < (max(2 * dense_err, 2e-2) if gpu else 1e-4), (ids.shape, err, dense_err)
            print(f"tokens {ids.numel()}: rel err vs float32 {err:.1e} (dense bf16 {dense_err:.1e})", flush=True)
    print(f"OK llama rank {mesh.rank}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
