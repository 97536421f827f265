"""GPU diagnostic: where the Triton fp8 pack differs from the CPU fallback (bench/gpu_diag.sh)."""

import torch

from dualpipe_kernels.kernels import pack, unpack

g = torch.Generator().manual_seed(0)
x = torch.randn(4097, generator=g) * 3
b_cpu, lay = pack([x], torch.float8_e4m3fn, backend="torch")
b_gpu, _ = pack([x.cuda()], torch.float8_e4m3fn, backend="triton")
b_gpu = b_gpu.cpu()
diff = (b_cpu != b_gpu).nonzero().flatten()
print("layout", lay.entries, "nbytes", lay.nbytes, "differing bytes", diff.numel())
print("first", diff[:20].tolist())
for i in diff[:10].tolist():
    print(i, int(b_cpu[i]), int(b_gpu[i]))
e = lay.entries[0]
print("scale region", e.scale_offset, "data", e.offset)
sc_cpu = b_cpu[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32)
sc_gpu = b_gpu[e.scale_offset : e.scale_offset + 4 * e.num_scales].view(torch.float32)
print("scales equal", torch.equal(sc_cpu, sc_gpu), sc_cpu[:4].tolist(), sc_gpu[:4].tolist())
back = unpack(b_cpu.cuda(), lay, backend="triton")[0].cpu()
ref = unpack(b_cpu, lay, backend="torch")[0]
print("unpack equal", torch.equal(back, ref), (back - ref).abs().max().item())
