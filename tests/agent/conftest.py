import pytest


@pytest.fixture
def export_registration(monkeypatch):
    """``check(out_dir, op, backend, version_hash)``: the backend registry loads the exports in ``out_dir`` on an
    sm90 GPU only (not on sm80), registering ``op``'s ``backend`` implementation with the exported file first among
    its fingerprinted sources and the version hash in its meta."""
    def check(out_dir, op, backend, version_hash):
        from areal_tik.dispatch import registry
        import areal_tik.kernels.exported as exp_pkg
        monkeypatch.setattr(exp_pkg, "__path__", [str(out_dir)])
        monkeypatch.setattr(registry, "_REGISTRY", {})
        avail = {"triton": lambda: (True, ""), "cuda": lambda: (False, ""), "torch_ref": lambda: (True, "")}
        monkeypatch.setattr(registry, "_gpu_arch", lambda: "sm80")
        registry._load_exported(avail)
        assert op not in registry._REGISTRY
        monkeypatch.setattr(registry, "_gpu_arch", lambda: "sm90")
        registry._load_exported(avail)
        info = registry._REGISTRY[op][backend]
        assert info.sources[0].endswith(f"{op}_sm90.py") and ("agent_export", version_hash) in info.meta
    return check
