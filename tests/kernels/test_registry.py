import logging
import subprocess
import sys

import pytest

from kernels import registry
from kernels.registry import choices, get, register, select, set_overrides, use_backends

OP = "toy_op"


def _impl(name):
    def fn():
        return name

    fn.__name__ = f"toy_{name}"
    return fn


@pytest.fixture
def toy(monkeypatch):
    """A toy op with all three backends, and availability independent of what this machine has installed:
    triton on cuda/npu (and cpu when ``TRITON_INTERPRET=1``), torch_npu on npu."""
    monkeypatch.setitem(registry._IMPLS, OP, {})
    for b in ("reference", "triton", "torch_npu"):  # (cpp: test_cpp_preferred_on_cpu_where_it_builds)
        register(OP, b)(_impl(b))
    monkeypatch.setitem(registry._AVAILABLE, "triton",
                        lambda d: d in ("cuda", "npu") or (d == "cpu" and registry.triton_interpret()))
    monkeypatch.setitem(registry._AVAILABLE, "torch_npu", lambda d: d == "npu")
    for var in ("TREX_KERNEL_BACKEND", "TREX_KERNEL_TOY_OP"):
        monkeypatch.delenv(var, raising=False)
    set_overrides(None)
    registry.clear_choices()
    yield
    registry.clear_choices()


def test_preference_per_device(toy, monkeypatch):
    assert get(OP, "npu")() == "torch_npu"
    assert get(OP, "cuda")() == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get(OP, "cpu")() == "reference"  # triton on CPU only when forced
    assert get(OP, "xpu")() == "reference"  # unknown device types: reference
    assert registry.available(OP, "npu") == ["torch_npu", "triton", "reference"]
    assert registry.backends(OP) == ["reference", "torch_npu", "triton"]


def test_cpp_preferred_on_cpu_where_it_builds(toy, monkeypatch):
    register(OP, "cpp")(_impl("cpp"))
    monkeypatch.setitem(registry._AVAILABLE, "cpp", lambda d: d == "cpu")
    assert get(OP, "cpu")() == "cpp"
    assert get(OP, "cuda")() == "triton" and get(OP, "npu")() == "torch_npu"
    with use_backends(toy_op="reference"):
        assert get(OP, "cpu")() == "reference"
    monkeypatch.setitem(registry._AVAILABLE, "cpp", lambda d: False)  # no compiler, or the build failed
    assert get(OP, "cpu")() == "reference"
    with use_backends(toy_op="cpp"), pytest.raises(KeyError, match="no available 'cpp' backend"):
        get(OP, "cpu")


def test_npu_without_torch_npu_prefers_triton(toy, monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "torch_npu", lambda d: False)
    assert get(OP, "npu")() == "triton"


def test_env_overrides(toy, monkeypatch):
    monkeypatch.setenv("TREX_KERNEL_BACKEND", "reference")
    assert get(OP, "cuda")() == "reference"
    monkeypatch.setenv("TREX_KERNEL_TOY_OP", "triton")  # per-op beats all-ops
    assert get(OP, "cuda")() == "triton"
    assert get(OP, "npu")() == "triton"


def test_programmatic_overrides_and_precedence(toy, monkeypatch):
    with use_backends("reference"):
        assert get(OP, "npu")() == "reference"
        with use_backends(toy_op="triton"):
            assert get(OP, "npu")() == "triton"
        assert get(OP, "npu")() == "reference"  # restored
    assert get(OP, "npu")() == "torch_npu"
    # most specific first: programmatic op > env op > programmatic * > env *
    monkeypatch.setenv("TREX_KERNEL_BACKEND", "triton")
    set_overrides({"*": "reference"})
    assert get(OP, "npu")() == "reference"
    monkeypatch.setenv("TREX_KERNEL_TOY_OP", "torch_npu")
    assert get(OP, "npu")() == "torch_npu"
    set_overrides({"*": "reference", OP: "triton"})
    assert get(OP, "npu")() == "triton"
    assert registry.overrides() == {"*": "reference", OP: "triton"}


def test_all_ops_override_skips_ops_without_that_backend(toy, monkeypatch):
    monkeypatch.setitem(registry._IMPLS, "ref_only", {"reference": _impl("reference")})
    with use_backends("torch_npu"):
        assert get(OP, "npu")() == "torch_npu"
        assert get("ref_only", "npu")() == "reference"
    with use_backends(ref_only="torch_npu"), pytest.raises(KeyError, match="not registered"):
        get("ref_only", "npu")


def test_unavailable_forced_backend_raises(toy, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("TREX_KERNEL_BACKEND", "triton")
    with pytest.raises(KeyError) as e:
        get(OP, "cpu")
    msg = str(e.value)
    assert "toy_op" in msg and "'triton'" in msg and "TREX_KERNEL_BACKEND" in msg and "['reference']" in msg
    with use_backends(toy_op="torch_npu"), pytest.raises(KeyError, match="no available 'torch_npu' backend"):
        get(OP, "cuda")
    with pytest.raises(KeyError, match="unknown kernel backend"):
        set_overrides({OP: "cuda_graphs"})
    monkeypatch.setenv("TREX_KERNEL_TOY_OP", "tritn")
    with pytest.raises(KeyError, match="unknown kernel backend 'tritn'"):
        get(OP, "cuda")
    with pytest.raises(KeyError, match="no kernel registered"):
        get("nope")


def test_triton_on_cpu_only_when_interpreted_and_forced(toy, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backends(toy_op="triton"):
        assert get(OP, "cpu")() == "triton"


def test_logs_once_per_choice_and_records_choices(toy, caplog):
    with caplog.at_level(logging.INFO, logger="trex.kernels"):
        for _ in range(3):
            get(OP, "cuda")
        get(OP, "npu")
        with use_backends("reference"):
            get(OP, "cuda")
            get(OP, "cuda")
        get(OP, "cuda")
    lines = [r.getMessage() for r in caplog.records if r.name == "trex.kernels"]
    assert lines == ["kernel toy_op on cuda: triton (preferred)", "kernel toy_op on npu: torch_npu (preferred)",
                     "kernel toy_op on cuda: reference (forced by set_overrides['*'])"]
    assert choices() == {"toy_op/cuda": "triton", "toy_op/npu": "torch_npu"}
    assert select(OP, "cpu") == "reference" and choices()["toy_op/cpu"] == "reference"


def test_register_backend_accepts_zero_arg_checks(toy, monkeypatch):
    monkeypatch.setitem(registry._AVAILABLE, "triton", registry._AVAILABLE["triton"])
    registry.register_backend("triton", lambda: False)
    assert get(OP, "cuda")() == "reference"


def test_real_backends_are_checked_lazily(monkeypatch):
    """torch_npu is never looked at off npu; triton on CPU needs TRITON_INTERPRET."""
    assert not registry.is_available("torch_npu", "cpu") and not registry.is_available("torch_npu", "cuda")
    assert "torch_npu" not in sys.modules
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not registry.is_available("triton", "cpu")
    assert get("rms_norm", "cpu") is registry._IMPLS["rms_norm"]["reference"]


def test_package_import_loads_no_backend():
    code = ("import sys, kernels; assert 'triton' not in sys.modules and 'torch_npu' not in sys.modules; "
            "print(sorted(kernels.registry.ops()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(registry.__file__).rsplit("/kernels/", 1)[0])
    for op in ("rms_norm", "add_rms_norm", "swiglu", "rope", "sinkhorn"):
        assert f"'{op}'" in out.stdout


def test_compiled_code_never_traces_into_a_triton_launch():
    """Under torch.compile (``train.<stage>.compile`` on CUDA) each Triton backend hands the compiler its op's
    definition to fuse (``traced``) or is called eagerly: tracing into a Triton launch breaks the graph inside
    the autograd Function, and dynamo then recompiles that frame for every shape it meets (seen on an H200)."""
    import kernels  # noqa: F401  (registers every op)
    from kernels.registry import _EAGER, _IMPLS, _TRACED

    triton_ops = sorted(op for op, impls in _IMPLS.items() if "triton" in impls)
    assert len(triton_ops) >= 10
    assert [op for op in triton_ops if (op, "triton") not in _TRACED and (op, "triton") not in _EAGER] == []


def test_dynamo_traces_the_model_with_every_triton_backend_without_entering_a_kernel(triton_device, monkeypatch):
    """The whole training loss under dynamo with every op on its Triton backend: it traces (a Triton launch met
    while tracing failed here, in the interpreter, and broke the graph on an H200) and no graph break is in a
    kernel -- the breaks left are the model's host syncs and the ops that run eagerly on purpose."""
    import torch

    from kernels.registry import resolve_all, use_backends
    from tests.trainer.helpers import tiny_model
    from trainer.data import IGNORE
    from trainer.models.deepseek_v4 import cpu_attention
    from trainer.models.deepseek_v4.training import loss_fn

    monkeypatch.setattr(cpu_attention, "CPU_PATH", False)  # the attention core through kernels.sink_attention
    model = tiny_model().to(triton_device)
    ids = torch.randint(0, model.embed.num_embeddings, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(triton_device)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
    batch = {"input_ids": ids, "doc_ids": torch.zeros_like(ids), "labels": labels}
    with use_backends("triton"):
        resolve_all(triton_device)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda: loss_fn(model, batch)[0])()
    where = [f.filename for r in explained.break_reasons for f in r.user_stack]
    assert explained.graph_count >= 2
    assert not [w for w in where if "triton" in w or w.endswith(("rms_norm.py", "rope.py", "swiglu.py",
                                                                 "sinkhorn.py", "router.py"))], where
