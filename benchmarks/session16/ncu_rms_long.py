"""One RMSNorm forward + backward at 1024 x 65536 bf16 (llama casting) through the library, for Nsight Compute
(session 16, call.sh ncu / stalls): three warm-up calls, then the profiled one between cudaProfilerStart/Stop."""
import os

os.environ["TRITON_INTERPRET"] = "0"
import torch  # noqa: E402

import fused_kernels as fk  # noqa: E402

x = torch.randn(1024, 65536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (1 + 0.1 * torch.randn(65536, device="cuda")).to(torch.bfloat16).requires_grad_()
dy = torch.randn(1024, 65536, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    fk.rms_norm(x, w, eps=1e-6).backward(dy)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
fk.rms_norm(x, w, eps=1e-6).backward(dy)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
