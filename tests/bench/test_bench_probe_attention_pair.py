"""bench/probes/probe_attention_pair.py on the CPU: the whole-run arithmetic, the fragments a child writes, and the
crash isolation (a child that dies, times out or loses its CUDA context costs its own cells only). The GPU cells
need FA3 and the csrc extension; here the children are stand-ins, in-process or real processes."""
import json
import os
import sys
import textwrap
import time

import pytest

PROBES = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "probes")
sys.path.insert(0, PROBES)

import probe_attention_pair as p  # noqa: E402

FA3_FAULT = ("CUDA error (/workspace/.deps/vllm-flash-attn-src/hopper/flash_fwd_launch_template.h:171): "
             "an illegal memory access was encountered")


def test_whole_run_integrates_decode_over_the_generated_contexts():
    # 1 ms per layer-call at every context: 4,096 steps x 28 layers = 114.688 s; the forward cell x 28 layers
    dec = {(64, c): 1.0 for c in (1024, 2048, 3072, 4096, 5120)}
    dec[(1, 4096)] = 99.0                     # other batches do not enter
    w = p.whole_run(dec, {(64, 5120): 10.0})
    assert w["decode_s"] == pytest.approx(4096 * 28 / 1e3)
    assert w["forward_s"] == pytest.approx(0.28)
    # linear in the context: the trapezoid is exact
    lin = {(64, c): c / 1024 for c in (1024, 3072, 5120)}
    assert p.whole_run(lin, {})["decode_s"] == pytest.approx((1 + 5) / 2 * 4096 * 28 / 1e3)


def test_whole_run_needs_both_ends_of_the_context_range():
    w = p.whole_run({(64, 1024): 1.0, (64, 3072): 1.0}, {})
    assert w["decode_s"] is None and w["forward_s"] is None
    assert p.whole_run({(64, 1024): 1.0, (64, 5120): None}, {})["decode_s"] is None   # a failed cell


def test_cells_cover_the_whole_run():
    B, lo, hi = p.LONG_ROLLOUT["batch"], p.LONG_ROLLOUT["prompt"], p.LONG_ROLLOUT["prompt"] + p.LONG_ROLLOUT["new"]
    assert (B, lo) in p.DECODE_CELLS and (B, hi) in p.DECODE_CELLS and (B, hi) in p.FORWARD_CELLS


# ---------------------------------------------------------------- stand-in children

def fake_ms(impl, part, unit):
    return {"split": 1.0, "walk": 2.0, "walk_auto": 3.0}[impl] + unit / 100 + (10 if part == "forward" else 0)


BITS_OK = dict(prefill_eq_decode=True, prefill_eq_chunk=True, max_abs_diff=0.0)


def finish(progress, impl, part, first):
    """What a healthy child writes: every unit from ``first`` on."""
    for unit in range(first, len(p.cell_labels(part))):
        progress.at(unit, "eager")
        progress.at(unit, "graph")
        progress.done(unit, dict(BITS_OK) if part == "bits" else dict(ms=fake_ms(impl, part, unit)))
    return 0, False, ""


def in_process_children(monkeypatch, behave):
    """Replace the child process by ``behave(progress, impl, part, first) -> (exit code, timed out, output)``,
    which writes the fragment through the real Progress; returns the list of (impl, part, first) it was asked."""
    calls = []

    def spawn(impl, part, first, fragment, log, timeout_s, launch_blocking):
        calls.append((impl, part, first))
        progress = p.Progress(fragment, impl, part)
        rc, timed_out, output = behave(progress, impl, part, first)
        progress.close()
        with open(log, "w") as f:
            f.write(output)
        return p.ChildOutcome(returncode=rc, timed_out=timed_out)

    monkeypatch.setattr(p, "spawn_child", spawn)
    return calls


def test_read_fragment_keeps_the_results_and_the_last_step_and_skips_a_line_cut_short(tmp_path):
    path = str(tmp_path / "f.jsonl")
    w = p.Progress(path, "walk", "decode")
    w.at(0, "eager")
    w.done(0, {"ms": 0.5})
    w.at(1, "graph")
    w.close()
    with open(path, "a") as f:
        f.write('{"done": {"unit": 1, "res')          # the child died mid-write
    done, at = p.read_fragment(path)
    assert done == {0: {"ms": 0.5}}
    assert at == {"unit": 1, "step": "graph"}
    assert p.read_fragment(str(tmp_path / "missing.jsonl")) == ({}, None)


def test_a_child_that_dies_costs_its_cell_and_the_part_goes_on_from_the_next(tmp_path, monkeypatch):
    def behave(progress, impl, part, first):
        if first == 0:                                  # the first child faults in cell 2's graph timing
            for unit in (0, 1):
                progress.at(unit, "graph")
                progress.done(unit, dict(ms=fake_ms(impl, part, unit)))
            progress.at(2, "eager")
            progress.at(2, "graph")
            return 1, False, f"@ walk decode: decode B8 ctx4096: graph\n{FA3_FAULT}\n"
        return finish(progress, impl, part, first)

    calls = in_process_children(monkeypatch, behave)
    results, crashes = p.measure_part("walk", "decode", str(tmp_path))
    assert [c[2] for c in calls] == [0, 3]
    n = len(p.DECODE_CELLS)
    assert sorted(results) == list(range(n))
    assert [results[u]["ms"] for u in range(n) if u != 2] == [fake_ms("walk", "decode", u) for u in range(n) if u != 2]
    assert results[2]["ms"] is None
    assert "exit code 1" in results[2]["error"] and "in graph" in results[2]["error"]
    assert "illegal memory access" in results[2]["error"]          # the last line that is not a progress marker
    (c,) = crashes
    assert (c["impl"], c["part"], c["unit"], c["cell"], c["step"]) == ("walk", "decode", 2, "decode B8 ctx4096",
                                                                       "graph")
    assert c["exit_code"] == 1 and not c["timed_out"]
    assert c["output_tail"][-1] == FA3_FAULT


def test_crash_text_names_the_step_and_the_last_message_not_the_progress_marker():
    crash = dict(step="graph", timed_out=False, exit_code=-11, timeout_s=None,
                 output_tail=["warming up", "Fatal Python error: Segmentation fault",
                              "@ walk decode: decode B1 ctx1024: graph"])
    assert p.crash_text(crash) == "child died (exit code -11) in graph: Fatal Python error: Segmentation fault"
    crash.update(step=None, output_tail=["@ walk decode: decode B1 ctx1024: inputs"])
    assert p.crash_text(crash) == "child died (exit code -11) before its first cell"


def test_a_child_that_loses_its_context_keeps_the_error_it_recorded(tmp_path, monkeypatch):
    def behave(progress, impl, part, first):
        if first == 0:
            progress.at(0, "graph")
            progress.done(0, dict(ms=None, error="graph: RuntimeError: CUDA error: an illegal memory access"))
            return p.CONTEXT_LOST_EXIT, False, "the CUDA context failed after that error; ending this child\n"
        return finish(progress, impl, part, first)

    calls = in_process_children(monkeypatch, behave)
    results, crashes = p.measure_part("split", "forward", str(tmp_path))
    assert [c[2] for c in calls] == [0, 1]
    assert results[0]["error"] == "graph: RuntimeError: CUDA error: an illegal memory access"
    assert all(results[u]["ms"] == fake_ms("split", "forward", u) for u in range(1, len(p.FORWARD_CELLS)))
    assert [c["exit_code"] for c in crashes] == [p.CONTEXT_LOST_EXIT]


def test_a_child_that_dies_before_its_first_cell_or_times_out_ends_the_part(tmp_path, monkeypatch):
    def dies_at_start(progress, impl, part, first):
        return 1, False, "ImportError: no FA3 here\n"

    calls = in_process_children(monkeypatch, dies_at_start)
    results, crashes = p.measure_part("walk", "forward", str(tmp_path / "a"))
    assert len(calls) == 1 and len(crashes) == 1 and crashes[0]["unit"] is None
    assert all(r["error"].startswith("not run: child died (exit code 1) before its first cell: ImportError")
               for r in results.values())

    def hangs_in_cell_1(progress, impl, part, first):
        progress.done(0, dict(ms=1.0))
        progress.at(1, "graph")
        return None, True, "@ walk decode: decode B1 ctx4096: graph\n"

    calls = in_process_children(monkeypatch, hangs_in_cell_1)
    results, crashes = p.measure_part("walk", "decode", str(tmp_path / "b"), timeout_s=7)
    assert len(calls) == 1
    assert results[0] == {"ms": 1.0}
    assert results[1]["error"] == "child timed out after 7 s in graph"
    assert all(results[u]["error"].startswith("not run: child timed out") for u in range(2, len(p.DECODE_CELLS)))
    assert crashes[0]["timed_out"] and crashes[0]["exit_code"] is None


def test_one_implementation_crashing_leaves_the_others_in_the_report(tmp_path, monkeypatch, capsys):
    facts = dict(gpu="stand-in", torch="x", fa3="vllm.vllm_flash_attn FA3", vllm="0.24")
    monkeypatch.setattr(p, "environment", lambda: (facts, list(p.IMPLS), None))
    crash_unit = p.DECODE_CELLS.index((64, 1024))

    def behave(progress, impl, part, first):
        if impl == "walk" and part == "decode" and first <= crash_unit:
            for unit in range(first, crash_unit):
                progress.done(unit, dict(ms=fake_ms(impl, part, unit)))
            progress.at(crash_unit, "graph")
            return 1, False, FA3_FAULT + "\n"
        return finish(progress, impl, part, first)

    in_process_children(monkeypatch, behave)
    assert p.main(["--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "attention_pair.json").read_text())
    assert res["row_bits"] == {n: BITS_OK for n in p.IMPLS}
    decode = [r for r in res["rows"] if r["kind"] == "decode"]
    forward = [r for r in res["rows"] if r["kind"] == "forward"]
    assert len(decode) == len(p.DECODE_CELLS) and len(forward) == len(p.FORWARD_CELLS)
    for unit, r in enumerate(decode):
        assert r["split"] == fake_ms("split", "decode", unit) and r["walk_auto"] == fake_ms("walk_auto", "decode", unit)
        assert "split_error" not in r and "walk_auto_error" not in r
        if unit == crash_unit:
            assert r["walk"] is None and "illegal memory access" in r["walk_error"]
        else:
            assert r["walk"] == fake_ms("walk", "decode", unit) and "walk_error" not in r
    assert [r["walk"] for r in forward] == [fake_ms("walk", "forward", u) for u in range(len(p.FORWARD_CELLS))]
    (c,) = res["crashes"]
    assert (c["impl"], c["part"], c["cell"], c["exit_code"]) == ("walk", "decode", "decode B64 ctx1024", 1)
    assert c["log"] == os.path.join(p.CHILD_DIR, "walk.decode.0.log")
    assert (tmp_path / c["log"]).read_text().strip() == FA3_FAULT
    # split and walk_auto have every cell of the long rollout; walk lost its prompt-length cell
    assert res["whole_run"]["split"]["decode_s"] is not None and res["whole_run"]["walk_auto"]["decode_s"] is not None
    assert res["whole_run"]["walk"]["decode_s"] is None and res["whole_run"]["walk"]["forward_s"] is not None
    out = capsys.readouterr().out
    assert "CRASH walk decode at decode B64 ctx1024 (graph): exit code 1" in out
    assert "error decode B64 ctx1024 walk: child died (exit code 1) in graph" in out


# ---------------------------------------------------------------- the child's own code, on the CPU

def paged_as_fa3_takes_it(q, kc, vc, bt, cq, sk, max_q, max_k):
    """A stand-in for the paged call that checks its arguments as FA3's mha_fwd does (dtypes, shapes, contiguity,
    one table row per sequence) and that the table and key counts are consistent with the cache."""
    import torch
    B = cq.shape[0] - 1
    assert q.dtype == kc.dtype == vc.dtype == torch.bfloat16 and q.shape[1:] == (p.HQ, p.D)
    assert kc.shape[1:] == (p.PAGE, p.HKV, p.D) and vc.shape == kc.shape and kc.is_contiguous()
    assert bt.dtype == cq.dtype == sk.dtype == torch.int32
    assert bt.stride(-1) == 1 and cq.is_contiguous() and sk.is_contiguous()
    assert bt.shape[0] == B and sk.shape == (B,)
    assert isinstance(max_q, int) and isinstance(max_k, int)
    n_q = cq.diff()
    assert int(cq[0]) == 0 and int(cq[-1]) == q.shape[0] and int(n_q.max()) <= max_q and int(sk.max()) <= max_k
    assert bool((n_q <= sk).all()) and bool((sk <= bt.shape[1] * p.PAGE).all())
    for b in range(B):
        pages = bt[b, :-(-int(sk[b]) // p.PAGE)]
        assert bool((pages >= 0).all()) and bool((pages < kc.shape[0]).all())
    return q.clone()


def varlen_as_fa3_takes_it(q, k, v, cu, max_len):
    import torch
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.shape[1:] == (p.HQ, p.D)
    assert k.shape == v.shape == (q.shape[0], p.HKV, p.D)
    assert cu.dtype == torch.int32 and cu.is_contiguous() and isinstance(max_len, int)
    assert int(cu[0]) == 0 and int(cu[-1]) == q.shape[0] and int(cu.diff().max()) <= max_len
    return q.clone()


@pytest.fixture
def child_on_cpu(monkeypatch):
    """The child's code with its inputs on the CPU, small cells, a stand-in timer and no CUDA calls."""
    import torch
    monkeypatch.setattr(p, "DEVICE", "cpu")
    monkeypatch.setattr(p, "DECODE_CELLS", [(1, 100), (3, 130)])
    monkeypatch.setattr(p, "FORWARD_CELLS", [(2, 96)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(p, "_time", lambda fn: (fn(), 0.25)[1])
    monkeypatch.setattr(p, "implementation", lambda name: (paged_as_fa3_takes_it, varlen_as_fa3_takes_it))
    return monkeypatch


@pytest.mark.parametrize("part", p.PARTS)
def test_the_child_passes_arguments_of_the_kind_fa3_takes_and_records_every_cell(tmp_path, child_on_cpu, part):
    fragment = str(tmp_path / "f.jsonl")
    assert p.run_child("walk", part, 0, fragment) == 0
    done, at = p.read_fragment(fragment)
    if part == "bits":
        assert done == {0: BITS_OK} and at == {"unit": 0, "step": "chunk"}
    else:
        assert done == {u: {"ms": 0.25} for u in range(len(p.cell_labels(part)))}
        assert at == {"unit": len(done) - 1, "step": "graph"}


def test_the_child_starts_at_its_first_unit(tmp_path, child_on_cpu):
    fragment = str(tmp_path / "f.jsonl")
    assert p.run_child("walk", "decode", 1, fragment) == 0
    assert list(p.read_fragment(fragment)[0]) == [1]


def test_a_failed_cell_is_recorded_and_a_lost_context_ends_the_child(tmp_path, child_on_cpu):
    import torch

    def fails(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    child_on_cpu.setattr(p, "implementation", lambda name: (fails, varlen_as_fa3_takes_it))
    fragment = str(tmp_path / "usable.jsonl")
    assert p.run_child("split", "decode", 0, fragment) == 0        # the context still works: every cell is tried
    done, _ = p.read_fragment(fragment)
    assert [r["error"] for r in done.values()] == [
        "eager: RuntimeError: CUDA error: an illegal memory access was encountered"] * 2

    def context_gone():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    child_on_cpu.setattr(torch.cuda, "synchronize", context_gone)
    fragment = str(tmp_path / "lost.jsonl")
    with pytest.raises(SystemExit) as ended:
        p.run_child("split", "decode", 0, fragment)
    assert ended.value.code == p.CONTEXT_LOST_EXIT
    done, at = p.read_fragment(fragment)
    assert list(done) == [0] and done[0]["ms"] is None and at == {"unit": 0, "step": "eager"}


# ---------------------------------------------------------------- real child processes (stand-in commands)

STAND_IN_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {probes!r})
    import probe_attention_pair as p
    impl, part, first, fragment = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    w = p.Progress(fragment, impl, part)
    mode = os.environ["STAND_IN_MODE"]
    if mode == "abort" and first == 0:
        w.at(0, "graph")
        print({fault!r}, file=sys.stderr, flush=True)
        os.abort()
    if mode == "hang":
        w.done(0, dict(ms=1.0))
        w.at(1, "eager")
        time.sleep(60)
    for unit in range(first, len(p.cell_labels(part))):
        w.at(unit, "graph")
        w.done(unit, dict(ms=float(unit), launch_blocking=os.environ.get("CUDA_LAUNCH_BLOCKING")))
""")


@pytest.fixture
def stand_in_child(monkeypatch):
    script = STAND_IN_CHILD.format(probes=os.path.abspath(PROBES), fault=FA3_FAULT)
    monkeypatch.setattr(p, "child_command",
                        lambda impl, part, first, fragment: [sys.executable, "-c", script, impl, part, str(first),
                                                             fragment])
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)

    def use(mode):
        monkeypatch.setenv("STAND_IN_MODE", mode)
    return use


def test_a_real_child_killed_by_a_signal_is_recorded_and_the_next_one_goes_on(tmp_path, stand_in_child):
    stand_in_child("abort")
    results, crashes = p.measure_part("walk_auto", "forward", str(tmp_path))
    (c,) = crashes
    assert c["exit_code"] == -6 and c["unit"] == 0 and c["step"] == "graph"     # SIGABRT
    assert FA3_FAULT in c["output_tail"]
    assert results[0]["ms"] is None and "exit code -6" in results[0]["error"]
    assert [results[u]["ms"] for u in range(1, len(p.FORWARD_CELLS))] == [1.0, 2.0, 3.0]


def test_a_real_child_past_its_timeout_is_killed(tmp_path, stand_in_child):
    stand_in_child("hang")
    t0 = time.time()
    results, crashes = p.measure_part("walk", "decode", str(tmp_path), timeout_s=3)
    assert time.time() - t0 < 30
    assert crashes[0]["timed_out"] and crashes[0]["unit"] == 1 and crashes[0]["step"] == "eager"
    assert results[0] == {"ms": 1.0} and results[1]["error"] == "child timed out after 3 s in eager"


@pytest.mark.parametrize("launch_blocking, seen", [(True, "1"), (False, None)])
def test_launch_blocking_reaches_the_children(tmp_path, stand_in_child, launch_blocking, seen):
    stand_in_child("ok")
    results, crashes = p.measure_part("split", "bits", str(tmp_path), launch_blocking=launch_blocking)
    assert crashes == [] and results[0]["launch_blocking"] == seen


def test_the_real_child_command_runs_this_script_and_its_failure_is_reported(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("on a GPU the real child measures; this checks the command line through its CPU refusal")
    results, crashes = p.measure_part("split", "bits", str(tmp_path), timeout_s=300)
    (c,) = crashes
    assert c["exit_code"] == 2 and c["unit"] is None
    assert "probe_attention_pair: needs a CUDA GPU" in c["output_tail"]
    assert results[0]["error"] == ("not run: child died (exit code 2) before its first cell: "
                                   "probe_attention_pair: needs a CUDA GPU")
