"""Host time per call of W4A8Linear (M <= 16), the layer function as wired, the Triton decode layer and F.linear.

``python eval/probes/host_time_w4a8.py`` (CUDA): per shape and M, :func:`host_time.host_and_wall` of each callable
(weights hot in L2, no flush).
"""

import torch
import torch.nn.functional as F
from host_time import host_and_wall

from quantpatch.kernels import w4a8_triton as wt
from quantpatch.w4a8_linear import W4A8Linear

torch.manual_seed(0)
print("host time per call (us), 200 calls with the GPU kept busy; then eager wall per call (us, 200 calls, synced)")
for k, n in ((4096, 4096), (4096, 14336), (14336, 4096)):
    lin = torch.nn.Linear(k, n, bias=False)
    mod = W4A8Linear.from_linear(lin).cuda()
    w = lin.weight.to(torch.bfloat16).cuda()
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = wt.gemm_config(m, n, k)
        fns = dict(
            module=lambda: mod(x),
            layer=lambda: wt.w4a8_linear_2d(x, mod.qweight, mod.scales, mod.pts_exp, mod.bias),
            triton_layer=lambda: wt.w4a8_linear_2d(x, mod.qweight, mod.scales, mod.pts_exp, mod.bias, config=cfg),
            bf16=lambda: F.linear(x, w),
        )
        row = [f"{name} {host:.1f}/{wall:.1f}" for name, (host, wall) in
               ((name, host_and_wall(fn)) for name, fn in fns.items())]
        print(f"K={k} N={n} M={m}: " + "  ".join(row), flush=True)
