"""Test set-up. The Triton interpreter must be switched on before triton is first imported, so it
happens here, at the top of the first file pytest loads. dev/gpu_check.sh sets TRITON_INTERPRET=0
to run the `gpu`-marked tests on a real GPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "cpu",
    max_examples=8,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "gpu", max_examples=20, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cpu"))

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available() and not INTERPRETER


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU with TRITON_INTERPRET=0 (dev/gpu_check.sh)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    """Where the kernels under test run: the GPU when the suite runs there, else the CPU (interpreter)."""
    return torch.device("cuda") if HAS_GPU else torch.device("cpu")


@pytest.fixture
def restore_patches():
    """Undo every patch the test made (the rule tests use it for every test: pytestmark)."""
    yield
    from autopatch import patching

    patching.restore_all()


@pytest.fixture(scope="module")
def kernels():
    """fused_kernels, imported once the interpreter setting above is in force."""
    import fused_kernels

    return fused_kernels
