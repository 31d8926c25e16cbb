"""AReaL's vLLM worker extension plus the one method the tik skip rule needs.

vLLM mixes ``--worker-extension-cls`` into its GPU worker, so these methods run in the process
that holds the model and samples; the API server calls them with ``collective_rpc``. AReaL's
weight-update methods are inherited unchanged, and the trainer's shared buffer loads by name
(``actor.tik.weight_transfer=ipc``); each successful load also advances a local serial, so the weights
digest is recomputed only after the weights changed.
"""
from __future__ import annotations

from areal.engine.vllm_ext.vllm_worker_extension import VLLMWorkerExtension

from areal_tik.areal.vllm_info import unwrap_model, worker_facts
from areal_tik.vllm_plugin import ARCHITECTURES, process_ops

__all__ = ["TikVLLMWorkerExtension"]


class TikVLLMWorkerExtension(VLLMWorkerExtension):
    _areal_tik_serial = 0
    _areal_tik_cache: tuple | None = None
    _areal_tik_shared: tuple | None = None     # (key, the trainer's shared buffer mapped in this worker)

    def _areal_tik_loaded(self, result):
        ok = isinstance(result, tuple) and bool(result[0])
        if ok:
            self._areal_tik_serial += 1
        return result

    def areal_update_weights(self, model_path):
        return self._areal_tik_loaded(super().areal_update_weights(model_path))

    def areal_update_weight_xccl(self):
        return self._areal_tik_loaded(super().areal_update_weight_xccl())

    def areal_tik_update_shared(self, body: dict):
        """Load the trainer's shared buffer (``engine/weight_ipc``; ``body`` as ``/update_weights_from_ipc`` takes
        it) into this worker's model by name: the buffer is mapped at its first update (a new key replaces the
        mapping), its views copied in (``load_weights``: unknown names or shapes refused before the tensor is
        written). ``(ok, message)`` as AReaL's update methods answer."""
        # lazy: keeps torch out of this module's import
        import torch
        from areal_tik.engine.weight_ipc import IPCError, mapped_views
        try:
            if not isinstance(body, dict):
                raise IPCError("the body must be an object")
            self._areal_tik_shared, tensors = mapped_views(self._areal_tik_shared, body.get("key"), body.get("handle"),
                                                           body.get("layout"))
            unwrap_model(self.model_runner.model).load_weights(tensors.items())
            buf = self._areal_tik_shared[1]
            if buf.is_cuda:
                torch.cuda.synchronize(buf.device)   # read out before the reply: the trainer refills the buffer
        except (IPCError, ValueError, RuntimeError) as e:
            return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return self._areal_tik_loaded((True, "Succeeded to update model weights."))

    def areal_tik_server_info(self) -> dict:
        """:func:`~areal_tik.areal.vllm_info.worker_facts` of this worker's model (digest cached per load)."""
        from areal_tik.vllm_plugin import logprobs as tik_logprobs  # lazy: keeps torch out of this module's import
        model = unwrap_model(self.model_runner.model)
        ops = process_ops() if type(model).__name__ in ARCHITECTURES.values() else None
        cached = self._areal_tik_cache
        if cached is not None and cached[0] == self._areal_tik_serial:
            digest_fn = lambda _m: cached[1]  # noqa: E731
        else:
            digest_fn = None
        facts = worker_facts(model, ops, tik_logprobs.installed(), digest_fn=digest_fn)
        self._areal_tik_cache = (self._areal_tik_serial, facts["weights_digest"])
        facts["rank"] = int(getattr(self, "rank", 0))
        return facts
