"""The vLLM rollout backend without vLLM: AReaL's real vLLM server module run against fake vLLM packages.

- the alias shim: with vLLM 0.24's layout AReaL's server does not import without it and does with it;
  with the old layout the shim changes nothing;
- ``vllm_server.main``: AReaL's server main runs unchanged, our ``/get_server_info`` and weight-update
  counting sit on the app it serves, the workers are asked only when they run the tik extension;
- the facts a worker reports (tik model, fingerprint, digest equal to the trainer's digest of the
  same weights) and the skip rule's refusal of a stock vLLM server, over HTTP;
- the command lines and environments of the stock and tik servers, and the config checks.
"""
import argparse
import asyncio
import importlib
import json
import logging
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

pytest.importorskip("areal.api")  # "areal" alone would find tests/areal itself (a namespace package)

from areal_tik.areal import vllm_compat, vllm_info, vllm_server  # noqa: E402
from areal_tik.areal.consensus import LOGPROB_DEFINITION, query_servers, server_disagreements  # noqa: E402

pytestmark = pytest.mark.areal

AREAL_SERVER = vllm_server.AREAL_SERVER
NEW = vllm_compat.NEW_HOME


# ---- fake packages -------------------------------------------------------------------------------
def _pkg(mods, name, **attrs):
    m = types.ModuleType(name)
    m.__path__ = []            # a package: a missing child is ModuleNotFoundError, as on disk
    m.__dict__.update(attrs)
    mods[name] = m
    return m


def _mod(mods, name, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    mods[name] = m
    return m


class FakeRoute:
    def __init__(self, path, methods, endpoint):
        self.path, self.methods, self.endpoint = path, set(methods), endpoint


class FakeRouter:
    def __init__(self):
        self.routes = []

    def post(self, path, **_kw):
        def deco(fn):
            self.routes.append(FakeRoute(path, ["POST"], fn))
            return fn
        return deco


class FakeApp:
    def __init__(self):
        self.router = FakeRouter()
        self.router.routes.append(FakeRoute("/v1/completions", ["POST"], "vllm's"))
        self.router.routes.append(FakeRoute("/health", ["GET"], "vllm's"))
        self.middlewares = []
        self.state = types.SimpleNamespace()

    def include_router(self, router):
        self.router.routes += router.routes

    def add_api_route(self, path, endpoint, methods):
        self.router.routes.append(FakeRoute(path, methods, endpoint))

    def add_middleware(self, cls, **options):
        self.middlewares.append((cls, options))


class FakeRequestCls:  # fastapi.Request
    pass


class FakeJSONResponse:
    def __init__(self, content, status_code=200):
        self.content, self.status_code = content, status_code


def _fastapi(mods):
    _mod(mods, "fastapi", APIRouter=FakeRouter, Depends=lambda f: ("Depends", f), Request=FakeRequestCls)
    _mod(mods, "fastapi.responses", JSONResponse=FakeJSONResponse)


def fake_vllm(layout: str, served: dict):
    """sys.modules entries of a fake vLLM: ``layout`` "0.24" (the four names in NEW_HOME only), "old"
    (only in the old modules) or "mixed" (old modules, one name moved). ``served`` receives the app."""
    mods: dict = {}
    _fastapi(mods)
    called = []
    names = dict(validate_json_request=lambda: None, cli_env_setup=lambda: called.append("cli_env_setup"),
                 load_aware_call=lambda f: f, with_cancellation=lambda f: f)
    _pkg(mods, "vllm")
    _pkg(mods, "vllm.entrypoints")
    _pkg(mods, "vllm.entrypoints.openai")
    if layout == "0.24":
        _pkg(mods, "vllm.entrypoints.serve")
        _pkg(mods, "vllm.entrypoints.serve.utils")
        _mod(mods, NEW, **names)
    elif layout == "old":
        _mod(mods, "vllm.entrypoints.openai.utils", validate_json_request=names["validate_json_request"])
        _mod(mods, "vllm.entrypoints.utils", **{k: names[k] for k in ("cli_env_setup", "load_aware_call",
                                                                      "with_cancellation")})
    else:  # mixed: with_cancellation moved
        _mod(mods, "vllm.entrypoints.openai.utils", validate_json_request=names["validate_json_request"])
        _mod(mods, "vllm.entrypoints.utils", cli_env_setup=names["cli_env_setup"],
             load_aware_call=names["load_aware_call"])
        _pkg(mods, "vllm.entrypoints.serve")
        _pkg(mods, "vllm.entrypoints.serve.utils")
        _mod(mods, NEW, **names)

    def build_app(args, supported_tasks=None, model_config=None):
        return FakeApp()

    async def run_server(args):
        served["app"] = sys.modules["vllm.entrypoints.openai.api_server"].build_app(args)
        served["args"] = args

    def make_arg_parser(p):
        for f in ("--model", "--host", "--port", "--worker-extension-cls", "--hf-overrides"):
            p.add_argument(f)
        return p

    _mod(mods, "vllm.entrypoints.openai.api_server", build_app=build_app, run_server=run_server)
    _mod(mods, "vllm.entrypoints.openai.cli_args", make_arg_parser=make_arg_parser,
         validate_parsed_serve_args=lambda a: None)
    _pkg(mods, "vllm.entrypoints.openai.completion")
    _mod(mods, "vllm.entrypoints.openai.completion.api_router", create_completion=lambda r, raw: "completed")
    _mod(mods, "vllm.entrypoints.openai.completion.protocol", CompletionRequest=object)
    _pkg(mods, "vllm.entrypoints.openai.engine")
    _mod(mods, "vllm.entrypoints.openai.engine.protocol", ErrorResponse=object, OpenAIBaseModel=object)
    _mod(mods, "vllm.logger", init_logger=logging.getLogger)
    _pkg(mods, "vllm.lora")
    _mod(mods, "vllm.lora.request", LoRARequest=object)
    _pkg(mods, "vllm.utils")
    _mod(mods, "vllm.utils.argparse_utils", FlexibleArgumentParser=argparse.ArgumentParser)
    return mods, names, called


@pytest.fixture
def vllm_layout(monkeypatch):
    """Install a fake vLLM of a layout; forget every vllm/fastapi module and AReaL's server afterwards."""
    def install(layout):
        served = {}
        mods, names, called = fake_vllm(layout, served)
        for k in [k for k in sys.modules if k == "vllm" or k.startswith(("vllm.", "fastapi"))]:
            monkeypatch.delitem(sys.modules, k)
        monkeypatch.delitem(sys.modules, AREAL_SERVER, raising=False)
        for k, v in mods.items():
            monkeypatch.setitem(sys.modules, k, v)
        return types.SimpleNamespace(mods=mods, names=names, served=served, called=called)
    yield install
    for k in [k for k in sys.modules if k == "vllm" or k.startswith(("vllm.", "fastapi"))] + [AREAL_SERVER]:
        sys.modules.pop(k, None)


# ---- the alias shim ------------------------------------------------------------------------------
def test_areal_server_needs_the_shim_on_vllm_024(vllm_layout):
    vllm_layout("0.24")
    with pytest.raises(ModuleNotFoundError, match="vllm.entrypoints.openai.utils"):
        importlib.import_module(AREAL_SERVER)       # negative control: AReaL's server as it is
    sys.modules.pop(AREAL_SERVER, None)
    added = vllm_compat.install_aliases()
    assert set(added) == {"vllm.entrypoints.openai.utils", "vllm.entrypoints.openai.utils:validate_json_request",
                       "vllm.entrypoints.utils", "vllm.entrypoints.utils:cli_env_setup",
                       "vllm.entrypoints.utils:load_aware_call", "vllm.entrypoints.utils:with_cancellation"}
    srv = importlib.import_module(AREAL_SERVER)
    home = sys.modules[NEW]
    for n in ("validate_json_request", "cli_env_setup", "load_aware_call", "with_cancellation"):
        assert getattr(srv, n) is getattr(home, n)
    assert sys.modules["vllm.entrypoints"].utils is sys.modules["vllm.entrypoints.utils"]
    assert vllm_compat.install_aliases() == []       # idempotent


def test_shim_leaves_an_old_vllm_untouched(vllm_layout):
    f = vllm_layout("old")
    before = {k: (v, dict(vars(v))) for k, v in f.mods.items()}
    assert vllm_compat.install_aliases() == []
    assert NEW not in sys.modules                    # the new home was never looked for
    for k, (mod, attrs) in before.items():
        assert sys.modules[k] is mod and dict(vars(mod)) == attrs
    importlib.import_module(AREAL_SERVER)             # the old layout imports as it always did


def test_shim_adds_only_the_missing_name(vllm_layout):
    f = vllm_layout("mixed")
    old = sys.modules["vllm.entrypoints.utils"]
    keep = old.cli_env_setup
    assert vllm_compat.install_aliases() == ["vllm.entrypoints.utils:with_cancellation"]
    assert sys.modules["vllm.entrypoints.utils"] is old and old.cli_env_setup is keep
    assert old.with_cancellation is f.names["with_cancellation"]


# ---- the server entry ----------------------------------------------------------------------------
class FakeEngineClient:
    def __init__(self, answers):
        self.answers, self.calls = answers, []

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        return self.answers


def _run_main(f, monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", ["vllm_server"])
    vllm_server.main(argv)
    app = f.served["app"]
    routes = {(r.path, m): r.endpoint for r in app.router.routes for m in r.methods}
    return app, routes


def _call(app, routes, path="/get_server_info", method="GET"):
    req = types.SimpleNamespace(app=app)
    return asyncio.run(routes[(path, method)](req)).content


def _middleware(app, path, status):
    """One request through the app's middleware (an ASGI class) to an inner app answering ``status``."""
    (cls, options), = app.middlewares
    sent = []

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": status})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message):
        sent.append(message)
    asyncio.run(cls(inner, **options)({"type": "http", "path": path}, None, send))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]   # passed on untouched


TIK_FACTS = {"model_class": "TikQwen2ForCausalLM", "tik_model": True, "logprob_hook": True,
             "kernel_fingerprint": "f" * 16, "kernel_selection": {"linear": "triton"}, "weights_digest": "d" * 16}


def test_main_runs_arealss_server_with_info_routes_tik(vllm_layout, monkeypatch):
    f = vllm_layout("0.24")
    argv = ["--model", "/m", "--port", "7", "--worker-extension-cls", vllm_info.TIK_WORKER_EXTENSION]
    app, routes = _run_main(f, monkeypatch, argv)
    assert f.served["args"].model == "/m" and f.served["args"].port == "7"   # AReaL's parser saw the argv
    assert f.called == ["cli_env_setup"]                                      # AReaL's main ran
    # AReaL's build_app patch ran over ours: its /v1/completions replaced vLLM's, its endpoints are there
    assert routes[("/v1/completions", "POST")] != "vllm's"
    assert ("/areal_update_weights", "POST") in routes and ("/areal_pause_generation", "POST") in routes
    assert ("/get_server_info", "GET") in routes and ("/get_server_info", "POST") in routes
    ep = routes[("/get_server_info", "GET")]
    assert ep.__annotations__["raw_request"] is FakeRequestCls   # FastAPI must see the class, not a string
    app.state.engine_client = client = FakeEngineClient([dict(TIK_FACTS)])
    info = _call(app, routes)
    assert client.calls == [vllm_info.INFO_RPC]
    assert info["kernels"] == "tik" and info["kernel_fingerprint"] == "f" * 16 and info["weights_digest"] == "d" * 16
    assert info["logprobs"].startswith(LOGPROB_DEFINITION) and info["weight_version"] == 0
    for path, status in [("/areal_pause_generation", 200), ("/areal_update_weights", 200),
                         ("/areal_pause_generation", 200), ("/areal_update_weights", 400),   # failed: no version
                         ("/areal_update_weights", 200), ("/v1/completions", 200)]:
        _middleware(app, path, status)
    assert _call(app, routes, method="POST")["weight_version"] == 2


def test_main_stock_server_never_asks_workers(vllm_layout, monkeypatch):
    f = vllm_layout("0.24")
    app, routes = _run_main(f, monkeypatch, ["--model", "/m", "--worker-extension-cls",
                                             "areal.engine.vllm_ext.vllm_worker_extension.VLLMWorkerExtension"])
    app.state.engine_client = client = FakeEngineClient([dict(TIK_FACTS)])
    info = _call(app, routes)
    assert client.calls == [] and info["kernels"] == "vllm" and info["kernel_fingerprint"] is None
    assert not info["logprobs"].startswith(LOGPROB_DEFINITION)


def test_weight_version_counts_updates_not_buckets():
    v = vllm_info.WeightVersion()
    for path in ["/areal_pause_generation", "/areal_update_weights_xccl", "/areal_update_weights_xccl",
                 "/areal_update_weights_xccl"]:
        v.observe(path, 200)
    assert v.version == 1                       # one xccl update = a pause then many buckets
    v.observe("/areal_pause_generation", 200)
    v.observe("/areal_update_weights_xccl", 500)
    assert v.version == 1                       # a failed bucket opens no version
    v.observe("/areal_update_weights_xccl", 200)
    v.observe("/areal_update_weights", 200)
    assert v.version == 3


# ---- what a worker reports -----------------------------------------------------------------------
def _tik_vllm_like_model(name="TikQwen2ForCausalLM", stray_ops=False):
    """The plugin's model without vLLM (``causal_lm.TikCausalLM``, what ``model.py`` subclasses) with a stand-in for
    vLLM's ``Attention`` (it holds a KV-cache scale parameter), loaded from a tiny HF Qwen2 the way the plugin
    loads one."""
    from areal_tik.dispatch.bound import bind
    from areal_tik.layers.models import build_model
    from areal_tik.layers.modules import TikLinear
    from areal_tik.vllm_plugin.causal_lm import TikCausalLM
    ops = bind(None)
    hf = build_model("tiny-qwen2", device="cpu", seed=3)
    Model = type(name, (TikCausalLM,), {})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)     # as vLLM builds it
    try:
        m = Model(hf.config, ops)
    finally:
        torch.set_default_dtype(prev)
    for layer in m.model.layers:     # vLLM's Attention layer, with a scale parameter
        layer.self_attn.attn = torch.nn.Module()
        layer.self_attn.attn.k_scale = torch.nn.Parameter(torch.ones(1))
    m.load_weights(hf.state_dict().items())
    if stray_ops:
        [x for x in m.model.layers[1].modules() if isinstance(x, TikLinear)][-1]._tik_ops = bind(None)
    return m, ops, hf


def _bump(m):
    """Change one weight of the model (the first projection of layer 0's MLP)."""
    from areal_tik.layers.modules import TikLinear
    lin = next(x for x in m.model.layers[0].mlp.modules() if isinstance(x, TikLinear))
    with torch.no_grad():
        lin.weight[0, 0] += 1.0


def test_worker_facts_digest_equals_the_trainers():
    from areal_tik.dispatch.bound import bind
    from areal_tik.dispatch.fingerprint import compute
    from areal_tik.layers.weights_digest import model_digest
    m, ops, hf = _tik_vllm_like_model()
    facts = vllm_info.worker_facts(m, ops, hook_installed=True)
    assert facts["tik_model"] and facts["kernel_fingerprint"] == compute(bind(None))["fingerprint"]
    assert facts["weights_digest"] == model_digest(hf)          # the trainer's digest of the same weights
    _bump(m)
    assert vllm_info.worker_facts(m, ops, True)["weights_digest"] != model_digest(hf)


@pytest.mark.parametrize("case", ["other_class", "stray_ops", "no_hook", "no_ops"])
def test_worker_facts_refuse_what_is_not_tik(case):
    m, ops, _ = _tik_vllm_like_model(name="Qwen2ForCausalLM" if case == "other_class" else "TikQwen2ForCausalLM",
                                     stray_ops=case == "stray_ops")
    facts = vllm_info.worker_facts(m, None if case == "no_ops" else ops, hook_installed=case != "no_hook",
                                   digest_fn=lambda _m: "d" * 16)
    info = vllm_info.server_info(model_path="/m", vllm_version="0.24.0", weight_version=0, workers=[facts])
    assert info["kernels"] == "vllm" and info["kernel_fingerprint"] is None
    assert (facts["tik_model"], facts["logprob_hook"]) == ((True, False) if case == "no_hook" else (False, True))


# ---- the skip rule against a vLLM server, over HTTP ----------------------------------------------
def _serve(body: dict):
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            data = json.dumps(body).encode()
            self.send_response(200 if self.path == "/get_server_info" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass
    srv = HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"127.0.0.1:{srv.server_address[1]}"


def test_skip_rule_refuses_a_stock_vllm_server_and_accepts_a_matching_tik_one():
    stock = vllm_info.server_info(model_path="/m", vllm_version="0.24.0", weight_version=3, workers=None)
    tik = vllm_info.server_info(model_path="/m", vllm_version="0.24.0", weight_version=3, workers=[dict(TIK_FACTS)])
    servers = [_serve(stock), _serve(tik)]
    try:
        answers = query_servers([a for _, a in servers], timeout=5)
    finally:
        for s, _ in servers:
            s.shutdown()
    bad = server_disagreements(answers[:1], version=3, own_fingerprint="f" * 16, own_digest="d" * 16)
    assert {r for r, _ in bad} == {"server_kernels", "fingerprint", "weights_digest", "logprob_definition"}
    assert server_disagreements(answers[1:], version=3, own_fingerprint="f" * 16, own_digest="d" * 16) == []
    assert {r for r, _ in server_disagreements(answers[1:], version=4, own_fingerprint="f" * 16,
                                               own_digest="d" * 16)} == {"server_version"}


# ---- command lines, environments, config ---------------------------------------------------------
@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(tmp_path)


def test_stock_command_is_arealss_with_our_module(model_dir):
    from areal.api.cli_args import vLLMConfig

    from areal_tik.areal.vllm_launch import SERVER_MODULE, vllm_cmd, vllm_server_args
    from areal_tik.settings import Settings
    cfg = vLLMConfig(model=model_dir)
    args = vllm_server_args(cfg, Settings(kernels="default", backend="triton"), host="127.0.0.1", port=9)
    cmd = vllm_cmd(args)
    theirs = vLLMConfig.build_cmd(cfg, tp_size=1, pp_size=1, host="127.0.0.1", port=9)
    assert cmd[0] == sys.executable and cmd[1:3] == ["-m", SERVER_MODULE]
    assert theirs[1:3] == ["-m", "areal.engine.vllm_ext.areal_vllm_server"] and cmd[3:] == theirs[3:]
    assert "areal_tik_env" not in args        # a stock server gets no tik environment


def test_tik_command_carries_the_plugin_engine_args(model_dir):
    from areal.api.cli_args import vLLMConfig

    from areal_tik.areal.vllm_launch import server_env, vllm_cmd, vllm_server_args
    from areal_tik.settings import Settings
    from areal_tik.vllm_plugin import llm_kwargs
    args = vllm_server_args(vLLMConfig(model=model_dir), Settings(kernels="tik", backend="triton"),
                            host="127.0.0.1", port=9)
    cmd = vllm_cmd(args)

    def val(flag):
        assert cmd.count(flag) == 1, (flag, cmd)
        return cmd[cmd.index(flag) + 1]
    kw = llm_kwargs("qwen2")
    assert json.loads(val("--hf-overrides")) == kw["hf_overrides"] == {"architectures": ["TikQwen2ForCausalLM"]}
    assert json.loads(val("--compilation-config")) == kw["compilation_config"]
    assert val("--attention-backend") == "CUSTOM" and val("--block-size") == "64"
    assert val("--worker-extension-cls") == vllm_info.TIK_WORKER_EXTENSION
    assert val("--model") == model_dir and "--no-enable-prefix-caching" in cmd
    env = server_env(args, device="cuda:1", environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert env["AREAL_TIK_BACKEND"] == "triton" and env["CUDA_VISIBLE_DEVICES"] == "5"
    assert server_env(args, device="cuda:1", environ={})["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(ValueError, match="one GPU per server"):
        vllm_server_args(vLLMConfig(model=model_dir), Settings(kernels="tik"), tp_size=2)


def test_server_pythonpath_replaces_the_servers_only(model_dir):
    """actor.tik.server_pythonpath reaches the server's environment, never its command line; both kinds."""
    from areal.api.cli_args import vLLMConfig

    from areal_tik.areal.vllm_launch import server_env, vllm_cmd, vllm_server_args
    from areal_tik.settings import Settings
    for kernels in ("default", "tik"):
        args = vllm_server_args(vLLMConfig(model=model_dir), Settings(kernels=kernels, backend="triton"),
                                host="127.0.0.1", port=9, pythonpath="/a:/b")
        env = server_env(args, environ={"PYTHONPATH": "/trainer"})
        assert env["PYTHONPATH"] == "/a:/b"
        assert not any("/a:/b" in c for c in vllm_cmd(args))
        assert (env.get("AREAL_TIK_BACKEND") == "triton") == (kernels == "tik")
    plain = vllm_server_args(vLLMConfig(model=model_dir), Settings(kernels="default"), host="127.0.0.1", port=9)
    assert server_env(plain, environ={"PYTHONPATH": "/trainer"})["PYTHONPATH"] == "/trainer"


def test_backend_launches_our_module(model_dir, monkeypatch):
    import subprocess

    from areal.api.cli_args import vLLMConfig

    from areal_tik.areal import vllm_launch
    from areal_tik.settings import Settings
    seen = {}
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, env, **kw: seen.update(cmd=cmd, env=env) or "proc")
    args = vllm_launch.vllm_server_args(vLLMConfig(model=model_dir), Settings(kernels="tik", backend="triton"))
    args.update(host="127.0.0.1", port=5)  # what AReaL's launch path adds
    assert vllm_launch.TikVLLMBackend().launch_server(args) == "proc"
    assert seen["cmd"][1:3] == ["-m", vllm_launch.SERVER_MODULE] and seen["env"]["AREAL_TIK_BACKEND"] == "triton"


def test_config_accepts_vllm_with_tik_and_names_what_it_refuses():
    from areal_tik.areal import engines
    from areal_tik.areal.config import ConfigError
    from areal_tik.areal.train import load_config
    import os
    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "tiny.yaml")

    def load(*ov):
        return load_config(["--config", recipe, "stats_logger.fileroot=/tmp/areal_tik/test_cfg", *ov])
    c = load("actor.kernel_backend=tik", "rollout.backend=vllm:d1p1t1")
    assert engines.for_config(c).name == "vllm"
    assert engines.for_config(load("actor.kernel_backend=tik")).name == "tik"
    assert engines.for_config(load("rollout.backend=vllm:d1p1t1")).name == "vllm"
    for ov, key in [("rollout.backend=vllm:d1t2", "rollout.backend"), ("+vllm.dtype=float16", "vllm.dtype"),
                    ("+vllm.enable_lora=true", "vllm.enable_lora"), ("rollout.backend=trt:d1", "rollout.backend")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load("actor.kernel_backend=tik", "rollout.backend=vllm:d1p1t1", ov)
    load("rollout.backend=vllm:d1t2")          # stock vLLM: tensor parallel is AReaL's business


@pytest.fixture
def worker_of(monkeypatch):
    """The tik worker extension (AReaL's, plus the tik methods) on fake vLLM modules: ``(make, loads)``, where
    ``make()`` gives ``(worker, hf)`` with a tik vLLM-like model (its weights those of ``hf``) under a full-graph
    wrapper, and ``loads`` records AReaL's disk loads."""
    mods: dict = {}
    _pkg(mods, "vllm")
    _mod(mods, "vllm.logger", init_logger=logging.getLogger)
    _pkg(mods, "vllm.lora")
    _mod(mods, "vllm.lora.lora_model", LoRAModel=object)
    _mod(mods, "vllm.lora.peft_helper", PEFTHelper=object)
    _mod(mods, "vllm.lora.request", LoRARequest=object)
    _pkg(mods, "vllm.model_executor")
    loads = []

    class Loader:
        def load_weights(self, model, model_config):
            loads.append(model_config.model)
            _bump(model)
    _mod(mods, "vllm.model_executor.model_loader", get_model_loader=lambda cfg: Loader())
    _mod(mods, "vllm.config", set_current_vllm_config=lambda *a, **k: __import__("contextlib").nullcontext())
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, k)
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    for k in ("areal.engine.vllm_ext.vllm_worker_extension", "areal_tik.areal.vllm_worker"):
        monkeypatch.delitem(sys.modules, k, raising=False)
    from areal_tik.areal.vllm_worker import TikVLLMWorkerExtension
    from areal_tik.vllm_plugin import logprobs as tik_logprobs
    from areal_tik import vllm_plugin

    class CUDAGraphWrapper:            # what a full-CUDA-graph vLLM runner holds instead of the model
        def __init__(self, runnable):
            self.runnable = runnable

        def __getattr__(self, name):
            return getattr(self.runnable, name)

    def make():
        m, ops, hf = _tik_vllm_like_model()
        monkeypatch.setattr(vllm_plugin, "_OPS", ops)            # the ops the worker's model was built with
        monkeypatch.setitem(tik_logprobs._STATE, "installed", True)
        w = TikVLLMWorkerExtension()
        w.model_runner = types.SimpleNamespace(model=CUDAGraphWrapper(m), model_config=types.SimpleNamespace(
            model="/old"), vllm_config=types.SimpleNamespace(load_config=None))
        w.sync = lambda: None
        return w, hf
    yield make, loads
    for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")] + [
            "areal.engine.vllm_ext.vllm_worker_extension", "areal_tik.areal.vllm_worker"]:
        sys.modules.pop(k, None)


def test_worker_extension_reports_facts_and_redigests_after_an_update(worker_of):
    """The digest is cached until a weight load succeeds, then recomputed from the new weights."""
    make, loads = worker_of
    w, hf = make()
    from areal_tik.layers.weights_digest import model_digest
    first = w.areal_tik_server_info()
    assert first["tik_model"] and first["logprob_hook"] and first["weights_digest"] == model_digest(hf)
    assert w.areal_update_weights("/new") == (True, "Success") and loads == ["/new"]
    second = w.areal_tik_server_info()
    assert second["weights_digest"] != first["weights_digest"]
    assert w.areal_tik_server_info()["weights_digest"] == second["weights_digest"]


def test_worker_extension_loads_the_trainers_shared_buffer(worker_of):
    """``actor.tik.weight_transfer=ipc`` on vLLM + tik: the worker maps the trainer's buffer (a /dev/shm file on a
    CPU) and loads it by name; its digest is then the trainer's. A bad layout or an unknown name is refused with
    the weights unchanged; a second update with the same key needs no handle."""
    from areal_tik.engine.weight_ipc import SharedWeights
    from areal_tik.layers.weights_digest import model_digest
    make, _ = worker_of
    w, hf = make()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.01)
    shared = SharedWeights(hf.named_parameters(), torch.bfloat16, "cpu")
    shared.fill(hf.named_parameters())
    body = shared.request()
    before = w.areal_tik_server_info()["weights_digest"]
    bad = [dict(body, layout=[[body["layout"][0][0], body["layout"][0][1], 10 ** 12]]),
           dict(body, layout=[["model.layers.0.not_a_weight", [4], 0]])]
    for b, kind in zip(bad, ("IPCError", "ValueError")):
        ok, msg = w.areal_tik_update_shared(b)
        assert not ok and msg.startswith(kind) and "\n" not in msg, msg
        assert w.areal_tik_server_info()["weights_digest"] == before
    assert w.areal_tik_update_shared(body)[0]
    assert w.areal_tik_server_info()["weights_digest"] == model_digest(hf) != before
    with torch.no_grad():
        next(hf.parameters()).add_(1.0)
    shared.fill(hf.named_parameters())
    assert w.areal_tik_update_shared(shared.request(with_handle=False))[0]
    assert w.areal_tik_server_info()["weights_digest"] == model_digest(hf)


def test_the_vllm_route_loads_on_every_worker_for_loopback_peers_only():
    import asyncio
    calls = []

    class Engine:
        def __init__(self, answers):
            self.answers = answers

        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            calls.append((method, args))
            return self.answers

        async def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache", ()))

    def request(host, answers, body=None):
        async def json():
            if body is None:
                raise ValueError("no JSON")
            return body
        return types.SimpleNamespace(client=types.SimpleNamespace(host=host), json=json,
                                     app=types.SimpleNamespace(state=types.SimpleNamespace(engine_client=Engine(answers))))
    from areal_tik.areal.vllm_server import load_shared
    ok = [(True, "done"), (True, "done")]
    status, body = asyncio.run(load_shared(request("127.0.0.1", ok, {"key": "k"})))
    assert status == 200 and body["workers"] == 2
    assert calls == [(vllm_info.IPC_RPC, ({"key": "k"},)), ("reset_prefix_cache", ())]
    calls.clear()
    assert asyncio.run(load_shared(request("10.0.0.7", ok, {"key": "k"})))[0] == 403 and calls == []
    status, body = asyncio.run(load_shared(request("::1", [(True, "done"), (False, "IPCError: bad")], {"key": "k"})))
    assert status == 400 and "IPCError: bad" in body["message"] and ("reset_prefix_cache", ()) not in calls
    assert asyncio.run(load_shared(request("127.0.0.1", ok)))[0] == 400
    v = vllm_info.WeightVersion()
    v.observe(vllm_info.IPC_UPDATE, 200)
    v.observe(vllm_info.IPC_UPDATE, 400)
    assert v.version == 1


def test_weight_counting_on_an_app_whose_middleware_stack_is_built():
    """vLLM 0.24's build_app ends by building the middleware stack (its SageMaker bootstrap); Starlette then
    refuses add_middleware. The counting middleware still goes on, outermost, and counts a real request."""
    starlette = pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def ok(request):
        return JSONResponse({"ok": True})

    def started_app():
        app = Starlette(routes=[Route(vllm_info.DISK_UPDATE, ok, methods=["POST"]), Route("/health", ok)])
        app.middleware_stack = app.build_middleware_stack()   # what vLLM 0.24's build_app leaves behind
        return app

    with pytest.raises(RuntimeError, match="after an application has started"):   # the failure this guards
        started_app().add_middleware(vllm_server.CountWeightUpdates, version=vllm_info.WeightVersion())
    app, version = started_app(), vllm_info.WeightVersion()
    vllm_server.add_outer_middleware(app, vllm_server.CountWeightUpdates, version=version)
    assert app.user_middleware[0].cls is vllm_server.CountWeightUpdates
    client = TestClient(app)
    assert client.get("/health").status_code == 200 and version.version == 0
    assert client.post(vllm_info.DISK_UPDATE).status_code == 200 and version.version == 1
    fresh, v2 = Starlette(routes=[Route(vllm_info.DISK_UPDATE, ok, methods=["POST"])]), vllm_info.WeightVersion()
    vllm_server.add_outer_middleware(fresh, vllm_server.CountWeightUpdates, version=v2)   # the plain path
    assert TestClient(fresh).post(vllm_info.DISK_UPDATE).status_code == 200 and v2.version == 1
    assert starlette.__version__
