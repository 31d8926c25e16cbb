"""HTTP server around :class:`LLMEngine` speaking the subset of SGLang's native API that
AReaL's ``RemoteSGLangEngine`` (``areal/engine/sglang_remote.py``) uses.

Endpoints (responses are ``Content-Type: application/json``; AReaL's client refuses others):

- ``GET /health`` -> 200 once the model is loaded;
- ``GET /model_info``, ``GET /get_server_info`` (also POST) -> model path, kernels mode
  (``tik`` | ``default``), the kernel fingerprint, the weight version and a digest of the
  loaded bf16 weights, and how log-probs are defined (``log_softmax(logits/T)``,
  unfiltered): what the trainer checks before skipping its recompute;
- ``POST /generate`` ``{input_ids, sampling_params, return_logprob, [logprob_start_len],
  [top_logprobs_num], stream=false}`` -> ``{text, output_ids, meta_info: {id,
  finish_reason: {type: stop|length|abort, ...}, prompt_tokens, completion_tokens,
  output_token_logprobs: [[logprob, token_id, None], ...], [input_token_logprobs],
  weight_version}}``. With ``max_new_tokens == 0`` or a ``logprob_start_len`` the input
  log-probs are returned (first position ``None``, like SGLang);
- ``POST /pause_generation`` -> in-flight requests return now with ``finish_reason.type
  == "abort"`` and their partial output (AReaL re-posts them with the output appended:
  regime R5), new requests wait until ``POST /continue_generation``;
- ``POST /update_weights_from_disk {model_path, abort_all_requests}`` -> loads
  synchronously (AReaL deletes the folder right after the reply), bumps the version;
- ``POST /update_weights_from_ipc {key, handle, layout, abort_all_requests}`` (loopback peers only) -> maps the
  trainer's shared buffer of every weight (``engine/weight_ipc``: a CUDA IPC handle on one GPU; once per key) and
  loads its views as from a checkpoint, bumps the version;
- ``POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  backend, group_name}`` -> joins the trainer's process group (AReaL's ``xccl`` mode);
  ``POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
  abort_all_requests}`` -> receives one bucket by broadcast from the trainer, checks and stages
  it. One weight update is every bucket between ``/pause_generation`` and
  ``/continue_generation``, applied as a whole at continue (the version advances once; a
  refused bucket refuses the whole update); a bucket outside a pause is an update of its own;
  ``POST /destroy_weights_update_group {group_name}`` -> leaves it (NCCL's teardown is
  collective: the trainer's own destroy waits for this one);
- ``POST /abort_request {rid | abort_all}`` -> ends one request, or every request (running or
  held during a pause), with ``finish_reason.type == "abort"`` and its output so far;
- ``POST /flush_cache`` -> no-op success (the engine keeps no cross-request cache that
  could go stale: weights changed means every KV page was freed by the abort).

Stepping happens in one background thread that alone touches the engine; HTTP handlers
hand it commands through a queue and await futures.

Hostile input: every body is checked before the engine sees it (``request_validation``); a
refusal is 400 (409: request id in flight, or a weight update with requests in flight and
no abort) with ``{"success": false, "message", "error": {"message", "type"}}``. A request
the engine fails on later fails alone (500); the others and the server carry on. A request
whose client goes away is ended in the engine (``client_watch``). Weight updates are all or
nothing (``worker_weights``).

Modules: ``config`` (ServerConfig), ``routes`` (TikServer, run_server), ``client_watch``
(clients that went away), ``worker`` (EngineWorker), ``worker_weights`` + ``weight_group`` (weight updates from disk,
shared memory and by broadcast), ``request_validation`` + ``http_errors`` (the edge), ``compose`` (the composition root: ``build``).
"""
from __future__ import annotations

from areal_tik.engine.server.compose import build
from areal_tik.engine.server.config import ServerConfig
from areal_tik.engine.server.routes import TikServer, run_server, serving
from areal_tik.engine.server.worker import EngineWorker

__all__ = ["ServerConfig", "TikServer", "EngineWorker", "build", "run_server", "serving"]
