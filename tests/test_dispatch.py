"""The shared fallback mechanism of fused_kernels._dispatch: a failed first build turns a path off once."""

import warnings

import pytest

from fused_kernels import _dispatch


@pytest.fixture(autouse=True)
def _clean():
    _dispatch.reset()
    yield
    _dispatch.reset()


def _boom():
    raise RuntimeError("PassManager::run failed")


def test_first_build_failure_turns_the_path_off_with_one_warning():
    with pytest.warns(RuntimeWarning, match=r"fused_kernels.demo: the cluster kernel did not build.*the Triton kernel"):
        assert _dispatch.run_path("demo", "cluster", ("k", 1), _boom, instead="the Triton kernel") is False
    assert not _dispatch.path_on("demo", "cluster")
    assert _dispatch.path_on("demo", "triton")
    assert _dispatch.path_on("other", "cluster")
    assert "PassManager" in _dispatch.turned_off()["demo/cluster"]


def test_a_key_that_ran_before_raises_and_a_forced_path_raises():
    ran = []
    assert _dispatch.run_path("demo", "cluster", "k", lambda: ran.append(1), instead="x") is True
    assert ran == [1]
    with pytest.raises(RuntimeError, match="PassManager"):
        _dispatch.run_path("demo", "cluster", "k", _boom, instead="x")
    assert _dispatch.path_on("demo", "cluster")
    with pytest.raises(RuntimeError, match="PassManager"):
        _dispatch.run_path("demo", "split", "k2", _boom, instead="x", forced=True)
    assert _dispatch.path_on("demo", "split")


def test_plan_is_a_readable_value():
    p = _dispatch.Plan("triton", config=(4, 8), reason="rows of 4096 fit in registers")
    assert p == _dispatch.Plan("triton", (4, 8), "rows of 4096 fit in registers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "4096" in repr(p)


def test_planned_again_refuses_the_path_that_was_turned_off():
    """After run_path turned a path off, an op's new plan must be another path: it is returned as is,
    and a plan that chose the same path again is an error naming the op and the plan."""
    triton_plan = _dispatch.Plan("triton", None, "the fallback")
    assert _dispatch.planned_again("demo", "cluster", triton_plan) is triton_plan
    with pytest.raises(RuntimeError, match="demo: plan\\(\\) chose the cluster path again"):
        _dispatch.planned_again("demo", "cluster", _dispatch.Plan("cluster", None, "again"))
