"""fused_kernels._gpu on the CPU: it imports under the interpreter (no Gluon there), one SM count off the
GPU, the device facts a plan sees, and the register cap the Gluon launches give ptxas."""

from __future__ import annotations


import torch

from fused_kernels import _gpu as gpu


def test_off_the_gpu():
    cpu = torch.device("cpu")
    assert gpu.sm_count(cpu) == gpu.sm_count("cpu") == gpu.OFF_GPU_SM_COUNT == 2
    assert gpu.device_facts(cpu) == gpu.OFF_GPU
    assert not gpu.OFF_GPU.cuda and not gpu.OFF_GPU.gluon and gpu.OFF_GPU.smem_per_sm == 0
    assert not gpu.gluon_available()  # the interpreter runs no Gluon kernel
    with gpu.device_guard(torch.zeros(1)):  # a no-op off the GPU
        pass


def test_register_cap():
    # 65536 registers per SM shared by per_sm CTAs of 32 · warps threads, in units of 8, at most 255
    assert gpu.register_cap(4, 8) == 64 and gpu.register_cap(8, 4) == 64 and gpu.register_cap(8, 3) == 80
    assert gpu.register_cap(4, 1) == 255 and gpu.register_cap(4, 7) == 72
    assert gpu.cta_bases(1) == [] and gpu.cta_bases(8) == [[1, 0, 0], [2, 0, 0], [4, 0, 0]]


def test_device_facts_are_hashable_values():
    h200 = gpu.DeviceFacts(cuda=True, sm_count=132, capability=(9, 0), smem_per_sm=233472, gluon=True)
    assert h200 == gpu.DeviceFacts(True, 132, (9, 0), 233472, True) and len({h200, gpu.OFF_GPU}) == 2
