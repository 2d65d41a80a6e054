"""A real client on 2 GPUs: a small Llama (transformers, random weights, no download) with its MLPs
swapped for et.nn.TensorParallelMLP; its logits must match the unsharded model's.

    torchrun --nproc_per_node=2 tests/gpu/llama_worker.py      -> 'OK llama' per rank
"""
import torch
import torch.distributed as dist
import transformers

import etdist as et


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main():
    dist.init_process_group("cpu:gloo,cuda:nccl")
    mesh = et.init_mesh()
    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=1000,
                                   max_position_embeddings=512)
    torch.manual_seed(0)  # the same model and tokens on every rank
    model = transformers.LlamaForCausalLM(cfg).to(mesh.device, torch.bfloat16).eval()
    batches = [torch.randint(0, 1000, shape, device=mesh.device) for shape in ((1, 9), (2, 77))]  # 9, 154 tokens
    with torch.no_grad():
        want = [model(ids).logits.float() for ids in batches]
        ref32 = [model.float()(ids).logits for ids in batches]
        model.to(torch.bfloat16)
        for layer in model.model.layers:
            layer.mlp = et.nn.TensorParallelMLP.from_dense(layer.mlp, mesh=mesh)
        assert isinstance(model.model.layers[1].mlp, et.nn.TensorParallelMLP)
        for ids, w, r in zip(batches, want, ref32):
            got = model(ids).logits.float()
            # the sharded bf16 model is as close to the float32 model as the dense bf16 one is
            err, dense_err = rel(got, r), rel(w, r)
            assert err < max(2 * dense_err, 2e-2), (ids.shape, err, dense_err)
            print(f"tokens {ids.numel()}: rel err vs float32 {err:.1e} (dense bf16 {dense_err:.1e})", flush=True)
    print(f"OK llama rank {mesh.rank}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
