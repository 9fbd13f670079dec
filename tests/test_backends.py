"""The attention kernel is chosen by running it (kernels/backends.py); xformers is optional."""

import builtins

import pytest
import torch

from specray.kernels import backends


@pytest.fixture(autouse=True)
def fresh_probe():
    backends.attention_backend.cache_clear()
    yield
    backends.attention_backend.cache_clear()


def test_cpu_always_sdpa(monkeypatch):
    assert backends.attention_backend("cpu")[0] == "sdpa"
    backends.attention_backend.cache_clear()
    monkeypatch.setenv(backends.ENV, "bogus")
    with pytest.raises(ValueError, match="SPECRAY_ATTENTION"):
        backends.attention_backend("cpu")


def test_an_importable_xformers_without_cuda_kernels_is_not_chosen(monkeypatch):
    """A CUDA machine whose xformers imports but cannot run (PyPI's wheel): SDPA, with the reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "_probe_xformers", lambda: "xformers' CUDA kernels do not run here (No operator found)")
    kernel, why = backends.attention_backend("cuda")
    assert kernel == "sdpa" and "No operator found" in why
    backends.attention_backend.cache_clear()
    monkeypatch.setenv(backends.ENV, "xformers")
    with pytest.raises(RuntimeError, match="SPECRAY_ATTENTION=xformers"):
        backends.attention_backend("cuda")
    backends.attention_backend.cache_clear()
    monkeypatch.setattr(backends, "_probe_xformers", lambda: None)
    monkeypatch.setenv(backends.ENV, "sdpa")
    assert backends.attention_backend("cuda") == ("sdpa", "PyTorch SDPA: SPECRAY_ATTENTION=sdpa")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_probe_on_this_gpu():
    kernel, why = backends.attention_backend("cuda")
    assert kernel in ("xformers", "sdpa") and why


def test_trees_without_xformers_equal_xformers_trees(monkeypatch):
    pytest.importorskip("xformers")
    from specray.kernels import tree

    real_import = builtins.__import__

    def no_xformers(name, *args, **kwargs):
        if name.startswith("xformers"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    for name, choices in tree.NAMED_TREES.items():
        given = tree.normalize_choices(choices)
        with_x = tree._build.__wrapped__(given)
        monkeypatch.setattr(builtins, "__import__", no_xformers)
        without = tree._build.__wrapped__(given)
        monkeypatch.setattr(builtins, "__import__", real_import)
        for field in ("parents", "mask", "depth"):
            assert torch.equal(getattr(with_x, field), getattr(without, field)), (name, field)
        assert with_x.topk == without.topk


@pytest.mark.slow  # starts processes
def test_a_fresh_install_without_xformers_imports_and_serves_trees(tmp_path):
    """`pip install .` does not install xformers (the optional "xformers" extra): the kernels
    import, trees build, and attention picks SDPA, in a process where xformers cannot import."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['xformers'] = None\n"  # any `import xformers...` raises ImportError
            "from specray.kernels import attention, backends, tree\n"
            "t = tree.build_tree([[0], [1], [0, 0]])\n"
            "assert t.parents.tolist() == [-1, 0, 0, 1], t.parents\n"
            "print(backends.attention_backend('cpu')[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("sdpa"), done.stderr[-2000:]
