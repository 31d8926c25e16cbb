"""Backend layer: registry of implementations, availability and the kernel fingerprint."""
from areal_tik.dispatch.registry import (BackendUnavailable, ImplInfo, backend_status, implementations, register,
                                        select_impl)

__all__ = ["BackendUnavailable", "ImplInfo", "backend_status", "implementations", "register", "select_impl"]
