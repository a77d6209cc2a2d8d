"""Patched models on two GPUs through the engines users run: Diffusers context parallelism (Ulysses, ring),
Transformers tensor parallelism, accelerate's ``device_map`` over cuda:0 / cuda:1.

Marked ``multigpu``; they run under ``torchrun --standalone --nproc-per-node 2 -m pytest -m multigpu tests/multigpu``
on a machine with 2 CUDA GPUs (``eval/run_multigpu_checks.sh`` does) and skip, saying so, anywhere else. Shapes are
small (the acceptance figures at full model size come from ``eval/multigpu_checks.py``); every call runs the kernels
(``policy="always"``). Floors: the CPU runs of the same checks (tests beside this file) less a margin.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist

import quantpatch as qp
from quantpatch.metrics import cos_sim

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
UNDER_TORCHRUN = os.environ.get("WORLD_SIZE") == "2"
pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs (run on the 2-GPU device machine)"),
    pytest.mark.skipif(not UNDER_TORCHRUN, reason="run under torchrun --standalone --nproc-per-node 2 -m pytest"),
]

COS_VS_ONE_GPU = 0.9999  # the same patched model, split over two GPUs, against one GPU
COS_VS_UNPATCHED = 0.999  # sage2-8b's bound on logits


@pytest.fixture(scope="module")
def rank():
    dist.init_process_group("nccl")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    yield dist.get_rank()
    dist.destroy_process_group()


def _kernel_routes(handle) -> set[str]:
    return {r for site in handle.sites for r in site.routes}


def _wan(device):
    pytest.importorskip("diffusers")
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)  # the same weights on both ranks (CPU init)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                                  in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    return model.to(device, torch.bfloat16).eval()


@pytest.mark.parametrize("config", [dict(ulysses_degree=2), dict(ring_degree=2)], ids=["ulysses", "ring"])
def test_wan_under_context_parallelism(rank, config):
    from diffusers.models._modeling_parallel import ContextParallelConfig

    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 5, 30, 52, generator=gen).to(device, torch.bfloat16),  # 1,950 tok
                  timestep=torch.tensor([500], device=device), return_dict=False,
                  encoder_hidden_states=torch.randn(1, 512, 4096, generator=gen).to(device, torch.bfloat16))
    model = _wan(device)
    parallel = copy.deepcopy(model)
    with torch.no_grad(), qp.patch_model(model, "sage2-8b", policy="always"):
        single = model(**inputs)[0]
    parallel.enable_parallelism(config=ContextParallelConfig(**config))
    with torch.no_grad(), qp.patch_model(parallel, "sage2-8b", policy="always") as handle:
        out = parallel(**inputs)[0]
    assert _kernel_routes(handle) == {"triton"}
    assert cos_sim(out, single) >= COS_VS_ONE_GPU


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=4)


def test_llama_under_tensor_parallelism(rank, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = [str(tmp_path_factory.mktemp("llama"))]
    dist.broadcast_object_list(path, 0)  # rank 0's folder
    if rank == 0:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16).save_pretrained(path[0])
    dist.barrier()
    model = transformers.AutoModelForCausalLM.from_pretrained(path[0], tp_plan="auto", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (1, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        unpatched = model(ids).logits[:, -1]
        with qp.patch_model(model, "sage2-8b", policy="always") as handle:
            patched = model(ids).logits[:, -1]
        assert _kernel_routes(handle) == {"triton"}
        assert cos_sim(patched, unpatched) >= COS_VS_UNPATCHED
        with qp.patch_model(model, "turbo", policy="always"):  # the TurboCache at any size
            generated = model.generate(ids[:, :200], max_new_tokens=40, do_sample=False)
    assert generated.shape == (1, 240)


def test_device_map_over_two_gpus(rank):
    """Layer 0 on cuda:0, layer 1 on cuda:1, cuda:0 current: the kernels of layer 1 run on cuda:1."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    if rank != 0:
        pytest.skip("one process drives both GPUs (rank 0)")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config()).to(torch.bfloat16).eval()
    one_gpu = copy.deepcopy(model).to("cuda:0")
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                  "model.norm": 1, "lm_head": 1}
    split = accelerate.dispatch_model(model, device_map=device_map)
    ids = torch.randint(0, 1024, (1, 1024), generator=torch.Generator().manual_seed(1)).to("cuda:0")
    torch.cuda.set_device(0)
    with torch.no_grad():
        with qp.patch_model(one_gpu, "sage2-8b", policy="always"):
            expected = one_gpu(ids).logits[:, -1].cpu()
        with qp.patch_model(split, "sage2-8b", policy="always") as handle:
            got = split(ids).logits[:, -1].cpu()
    assert torch.cuda.current_device() == 0
    assert _kernel_routes(handle) == {"triton"}
    assert all(hasattr(split.model.layers[i], "_hf_hook") for i in range(2))
    assert cos_sim(got, expected) >= COS_VS_ONE_GPU
