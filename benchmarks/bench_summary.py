"""The summary (targets met or not) and the printed table of `make bench` (benchmarks/run_all.py);
docs/performance.md describes the table."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

PEER_STEP_S = 6.5  # original DAT code, WRN-16-4, batch 32, T = K = 10, 2-core CPU, 2 threads
TARGETS = {
    "ddp_efficiency": 0.90,  # images/s on 2 ranks x 1 thread / 1 rank x 2 threads, >=
    "eval_speedup": 1.6,  # 1 rank x 2 threads time / 2 ranks x 1 thread time, >=
    "resume_difference_s": 1.0,  # |resume at step 10,000 - resume at step 10|, <=
    "peer_ratio": 0.8,  # rebm dat_step / 6.5 s, <= (at least 20 % faster)
    "overhead_ratio": 1.05,  # loop step / minimal hand-written step, <=
    "default_vs_old": 0.90,  # channels_last eager dat_step / NCHW eager's, <=
    "prc_ratio": 0.6,  # sharded precision/recall: 2 processes x 1 thread / 1 x 1, <=
    "default_vs_eager": 0.90,  # a long run's default dat_step / the eager unfused one's, <=
    "vs_original": 0.75,  # rebm default step / the original code's step, same machine, <= (issue 42)
}


def _get(results: dict, key: str, *path, default=None):
    value = results.get(key)
    for part in path:
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


def summarize(results: dict) -> dict:
    s: Dict[str, dict] = {}
    rows = _get(results, "original/wrn", "rows")
    if rows:
        ratio = rows["default"]["ratio_to_original"]
        s["vs_original/wrn"] = {"value": ratio, "target": f"<= {TARGETS['vs_original']}",
                                "met": ratio <= TARGETS["vs_original"],
                                "rows_ms": {k: v["ms_per_step"] for k, v in rows.items()}}
    for cfg in ("quickstart", "wrn"):
        ws1 = _get(results, f"ddp/{cfg}/ws1", "images_per_s")
        ws2 = _get(results, f"ddp/{cfg}/ws2", "images_per_s")
        if ws1 and ws2:
            s[f"ddp_efficiency/{cfg}"] = {"value": ws2 / ws1, "target": ">= 0.90",
                                         "met": ws2 / ws1 >= TARGETS["ddp_efficiency"],
                                         "ws1_images_per_s": ws1, "ws2_images_per_s": ws2}
        ratio = _get(results, f"steps/{cfg}", "overhead_ratio")
        if ratio:
            s[f"overhead/{cfg}"] = {"value": ratio, "target": "<= 1.05",
                                    "met": ratio <= TARGETS["overhead_ratio"],
                                    "paired": _get(results, f"steps/{cfg}",
                                                   "overhead_ratio_paired")}
        diff = _get(results, f"resume/{cfg}", "difference_s")
        if diff is not None:
            s[f"resume/{cfg}"] = {"value": diff, "target": "|diff| <= 1 s",
                                  "met": abs(diff) <= TARGETS["resume_difference_s"]}
    peer = results.get("peer/wrn", {})
    step = _get(results, "peer/wrn", "dat_step_s", "default")
    eager = _get(results, "peer/wrn", "dat_step_s", "eager")
    old_default = _get(results, "peer/wrn", "dat_step_s", "nchw")
    if eager and old_default:
        s["default_vs_old"] = {"value": eager / old_default, "target": "<= 0.90",
                               "met": eager / old_default <= TARGETS["default_vs_old"]}
    if step and eager:
        s["default_vs_eager"] = {"value": step / eager, "target": "<= 0.90",
                                 "met": step / eager <= TARGETS["default_vs_eager"]}
    if step:
        best = min(peer["dat_step_s"].values())
        gflop, gemm = peer["step_gflop"], peer["gemm_gflops"]
        # judged on the default (channels_last auto, eager); the options are reported beside it
        s["peer"] = {"value": step / PEER_STEP_S, "dat_step_s": step, "peer_s": PEER_STEP_S,
                     "variants_s": peer["dat_step_s"],
                     "best_ratio": best / PEER_STEP_S,
                     "target": "<= 0.80 (<= 5.2 s)",
                     "met": step / PEER_STEP_S <= TARGETS["peer_ratio"],
                     # the FLOP rate each step time implies, against the machine's GEMM rate
                     "step_gflop": gflop, "gemm_gflops": gemm,
                     "achieved_gflops": gflop / best,
                     "peer_implied_gflops": gflop / PEER_STEP_S,
                     "target_implied_gflops": gflop / (TARGETS["peer_ratio"] * PEER_STEP_S)}
    e1, e2 = _get(results, "eval/ws1", "eval_s"), _get(results, "eval/ws2", "eval_s")
    e11 = _get(results, "eval/ws1t1", "eval_s")
    indep = _get(results, "eval/ws2_independent", "eval_s")
    if e1 and e2:
        s["eval_speedup"] = {"value": e1 / e2, "target": ">= 1.6",
                             "met": e1 / e2 >= TARGETS["eval_speedup"],
                             "ws1_s": e1, "ws2_s": e2, "ws1_1thread_s": e11,
                             "vs_1thread": e11 / e2 if e11 else None}
        if indep:
            # two ranks that each do the whole set concurrently take `indep`; a perfect split
            # of one set over them takes indep / 2: the best any 2-rank evaluation can do here
            s["eval_speedup"].update(independent_s=indep, ceiling=e1 / (indep / 2),
                                     contention_slowdown=indep / e11 if e11 else None,
                                     of_ceiling=(indep / 2) / e2)
    prc = results.get("prc") or {}
    if prc.get("ratio_2ranks_to_1"):
        s["prc_ratio"] = {"value": prc["ratio_2ranks_to_1"], "target": "<= 0.6",
                          "met": prc["ratio_2ranks_to_1"] <= TARGETS["prc_ratio"]}
    shares = eval_shares(results, s)
    if shares:
        s["eval_share"] = shares
    for name in ("quickstart", "wrn"):
        ratio = _get(results, "attack", "models", name, "ratio")
        if ratio:
            s[f"attack/{name}"] = {"value": ratio}
    return s


def eval_shares(results: dict, summary: dict) -> List[dict]:
    """The share of wall time periodic evaluation takes at each shipped CIFAR config's interval,
    estimated from per-image costs measured on the benchmark's model (section `evalshare`),
    scaled to the config's model by forward FLOPs (Inception for FID is not scaled), with T at
    its curriculum maximum (the most training per interval: a lower bound on the share early
    in a run). 2 ranks: training divided by the measured DDP speed-up (ddp/wrn), evaluation by
    the measured evaluation speed-up (eval)."""
    e = results.get("evalshare/wrn") or {}
    if "train_image_s" not in e:
        return []
    ddp = _get(summary, "ddp_efficiency/wrn", "value")
    eval_speedup = _get(summary, "eval_speedup", "value")
    out = []
    for w in e["shipped"]:
        scale = e["model_gflop"][w["model"]] / e["model_gflop"][e["label"].split(",")[0]]
        attack, forward = e["attack_step_image_s"], e["forward_image_s"]
        # the step's work besides its T + K attack steps: the fused loss pass, optimizer, EMA
        rest = max(0.0, e["train_image_s"] - (e["T"] + e["K"]) * attack)
        train = w["interval_images"] * ((w["T"] + w["K"]) * attack + rest) * scale
        parts = {
            "accuracy": w["test_images"] * ((2 if w["robust_steps"] else 1) * forward
                                            + w["robust_steps"] * attack) * scale,
            "samples": (w["samples"] * w["sample_steps"] + w["sweep_pgd_image_steps"])
            * attack * scale,
            "fid": w["fid_images"] * e["inception_image_s"],
        }
        evaluation = sum(parts.values())
        row = {"config": w["config"], "train_h": train / 3600, "eval_h": evaluation / 3600,
               "parts_h": {k: v / 3600 for k, v in parts.items()},
               "share_ws1": evaluation / (train + evaluation), "share_ws2": None}
        if ddp and eval_speedup:
            row["share_ws2"] = (evaluation / eval_speedup) / (
                train / ddp + evaluation / eval_speedup)
        out.append(row)
    return out


def _fmt(value, unit: str = "s", digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if unit == "s":
        return f"{value:.{digits}f}"
    return f"{value:.{digits}f}{unit}"


def _mark(entry: Optional[dict]) -> str:
    if not entry or "met" not in entry:
        return ""
    return "  [target met]" if entry["met"] else "  [target MISSED]"


COLS = ("quickstart", "wrn")
PEER_VARIANT_LABELS = {"nchw": "NCHW, eager, two attack passes",
                       "eager": "channels_last, eager, two passes",
                       "compiled": "eager + model.compile=true",
                       "fused": "eager + fuse_attacks=true",
                       "compiled_fused": "eager + compile + fuse_attacks",
                       "default": "default of a long run (auto)"}
BREAKDOWN_ROWS = [
    ("data wait (num_workers=0)", "data_wait"),
    ("negative-sample attack (T PGD steps)", "neg_attack"),
    ("classifier attack (K PGD steps)", "clf_attack"),
    ("forward + backward (fused, 3B images)", "fwd_bwd"),
    ("optimizer step (+ zero_grad)", "optimizer"),
    ("EMA update", "ema"),
    ("bookkeeping (AUC, curriculum, consensus)", "bookkeeping"),
    ("logging + images + checkpoint, amortized", "logging_checkpoint_amortized"),
]


def _header(meta: dict) -> List[str]:
    lines = [f"rebm training-speed benchmark | torch {meta['torch']} | {meta['cores']} cores "
             f"({meta['cpu']}) | "
             f"{'QUICK smoke run (numbers are noise)' if meta['quick'] else 'default'}"
             f" | {meta['date']}"]
    load = meta["loadavg_start"][0]
    if load > 0.5:
        lines.append(f"WARNING: load average {load:.2f} at the start: other processes compete "
                     "for the cores, so these figures (2-thread ones above all) are not "
                     "representative.")
    return lines


def _row(title: str, cells) -> str:
    return f"   {title:44s}" + "".join(f"{cell:>16s}" for cell in cells)


def _breakdown(results: dict, summary: dict, meta: dict) -> List[str]:
    def piece(c: str, *path) -> str:
        return _fmt(_get(results, f"breakdown/{c}", *path))

    def comm(c: str) -> str:
        exp = _get(results, f"ddp/{c}/ws2", "exposed_allreduce_s")
        raw = _get(results, f"ddp/{c}/ws2", "raw_allreduce_s")
        return "n/a" if exp is None else f"{exp:.3f} / {raw:.3f}"

    lines = [f"1. Step time breakdown: 1 process, {meta['cores']} threads, median s per "
             "optimizer step"]
    lines += [f"   {c}: {_get(results, f'breakdown/{c}', 'label', default=c)}" for c in COLS]
    lines.append(f"   {'piece':44s}" + "".join(f"{c:>16s}" for c in COLS))
    lines += [_row(title, [piece(c, "per_step_s", key) for c in COLS])
              for title, key in BREAKDOWN_ROWS]
    lines.append(_row("grad all-reduce, 2 ranks (exposed / raw)", [comm(c) for c in COLS]))
    lines.append(_row("sum of pieces", [piece(c, "sum_of_pieces_s") for c in COLS]))
    lines.append(_row("full loop step incl. data (measured)",
                      [piece(c, "full_loop_step_s") for c in COLS]))
    for c in COLS:
        ev = _get(results, f"breakdown/{c}", "per_event_s")
        iv = _get(results, f"breakdown/{c}", "intervals_imgs")
        if ev and iv:
            lines.append(
                f"   {c} per event: metrics log {ev['metrics_log']:.3f} s every "
                f"{iv['metrics_log']} imgs, image grid {ev['image_log']:.3f} s every "
                f"{iv['image_log']}, checkpoint {ev['checkpoint']:.3f} s every {iv['checkpoint']}")
    return lines


def _ddp_line(results: dict, summary: dict, c: str) -> str:
    e = summary.get(f"ddp_efficiency/{c}")
    if not e:
        return f"   {c:12s} n/a"
    return (f"   {c:12s} {e['ws1_images_per_s']:8.2f} -> {e['ws2_images_per_s']:8.1f} images/s"
            f"   efficiency {e['value']:.3f} (target >= 0.90){_mark(e)}")


def _attack_line(results: dict, summary: dict, name: str) -> Optional[str]:
    m = _get(results, "attack", "models", name)
    if not m:
        return None
    ms = {key: m[key] * 1e3 for key in ("attack_step_s", "fwd_bwd_s")}
    return (f"   {m['model']:16s} {m['image_size']:2d} px batch {m['batch']:3d}: attack "
            f"{ms['attack_step_s']:8.1f} ms, fwd+bwd {ms['fwd_bwd_s']:8.1f} ms, "
            f"ratio {m['ratio']:.3f} (paired {m['ratio_paired']:.3f})")


def _eval(results: dict, summary: dict, meta: dict) -> List[str]:
    e = summary.get("eval_speedup")
    lines = ["4. Evaluation (accuracy + robust accuracy, digits test set)"]
    if not e:
        return lines + ["   n/a"]
    lines.append(f"   {_get(results, 'eval/ws1', 'n_test')} images: 1 rank x 2 threads "
                 f"{e['ws1_s']:.3f} s, 2 ranks x 1 thread {e['ws2_s']:.3f} s, speed-up "
                 f"{e['value']:.2f}x (target >= 1.6){_mark(e)}")
    if e.get("vs_1thread"):
        lines.append(f"   reference: 1 rank x 1 thread {e['ws1_1thread_s']:.3f} s: speed-up of 2 "
                     f"ranks over 1 at 1 thread per rank {e['vs_1thread']:.2f}x")
    if e.get("ceiling"):
        lines.append(
            f"   ceiling: 2 ranks x 1 thread each evaluating the whole set at once take "
            f"{e['independent_s']:.3f} s ({e['contention_slowdown']:.2f}x one rank alone), so a "
            f"perfect split takes {e['independent_s'] / 2:.3f} s: best possible "
            f"speed-up {e['ceiling']:.2f}x; rebm reaches {e['of_ceiling']:.0%} of it")
    return lines


def _resume_line(results: dict, summary: dict, c: str) -> Optional[str]:
    r = _get(results, f"resume/{c}", "at_step")
    if not r:
        return None
    first, last, d = r["10"], r["10000"], summary[f"resume/{c}"]
    return (f"   {c:10s} step 10: {first['total']:.3f} s (read_state {first['read_state']:.3f})"
            f"  step 10,000: {last['total']:.3f} s (read_state {last['read_state']:.3f})"
            f"  difference {d['value']:+.3f} s (target |diff| <= 1 s){_mark(d)}")


def _checkpoint(results: dict, summary: dict, meta: dict) -> List[str]:
    c = results.get("checkpoint/wrn", {})
    title = "6. Checkpoint (WRN-16-4 training state: model + optimizer + EMA + RNG + config)"
    if "save_training_state_s" not in c:
        return [title, "   n/a"]
    return [title, f"   {c['state_mib']:.1f} MiB: save_training_state "
            f"{c['save_training_state_s']:.3f} s (state_dict assembly "
            f"{c['state_dict_assembly_s']:.3f} s, {c['write_mib_per_s']:.0f} MiB/s incl. fsync); "
            f"training is blocked {c['training_blocked_s']:.3f} s per checkpoint (synchronous on "
            f"rank 0, the other ranks wait in the consensus); read_state "
            f"{c['read_state_s']:.3f} s"]


def _rss(results: dict, summary: dict, meta: dict) -> List[str]:
    rows = {key: value.get("max_rss_mib") for key, value in results.items()
            if isinstance(value, dict)}
    return ["7. Peak RSS per rank (MiB, ru_maxrss)"] + [
        f"   {key:24s} " + ", ".join(f"rank {i}: {v:.0f}" for i, v in enumerate(rss))
        for key, rss in rows.items() if rss]


def _peer(results: dict, summary: dict, meta: dict) -> List[str]:
    p = summary.get("peer")
    lines = ["8. Peer comparison: dat_step, WRN-16-4, 32 px, batch 32, T=10, K=10, fp32, "
             "frozen BN, SGD"]
    if p and meta["quick"]:
        return lines + [f"   --quick runs T = K = 2: no comparison (dat_step "
                        f"{p['dat_step_s']:.3f} s)"]
    if not p:
        return lines + ["   n/a"]
    lines.append(f"   rebm {p['dat_step_s']:.3f} s vs original {PEER_STEP_S} s: ratio "
                 f"{p['value']:.3f} (target <= 0.80){_mark(p)}")
    for name, label in PEER_VARIANT_LABELS.items():
        seconds = p["variants_s"].get(name)
        if seconds and name != "default":
            lines.append(f"   {label:29s} {seconds:.3f} s: ratio {seconds / PEER_STEP_S:.3f}")
    return lines + [
        f"   the step is {p['step_gflop']:.0f} GFLOP (FlopCounterMode): rebm runs at "
        f"{p['achieved_gflops']:.0f} GFLOP/s at best; a float32 GEMM (2048^2) reaches "
        f"{p['gemm_gflops']:.0f} GFLOP/s; {PEER_STEP_S} s would need "
        f"{p['peer_implied_gflops']:.0f} GFLOP/s and the target "
        f"{p['target_implied_gflops']:.0f} GFLOP/s"]


def _overhead_line(results: dict, summary: dict, c: str) -> Optional[str]:
    o, st = summary.get(f"overhead/{c}"), results.get(f"steps/{c}", {})
    return o and (f"   {c:12s} {st['loop_step_s']:.3f} s / {st['minimal_step_s']:.3f} s = "
                  f"{o['value']:.3f} (paired {o['paired']:.3f}; target <= 1.05){_mark(o)}")


def _each_config(title: str, render: Callable[[dict, dict, str], Optional[str]]) -> Callable:
    """A table section: the title, then `render`'s line for each configuration that has one."""
    def part(results: dict, summary: dict, meta: dict) -> List[str]:
        return [title, *filter(None, (render(results, summary, c) for c in COLS))]
    return part


def _speed_options(results: dict, summary: dict, meta: dict) -> List[str]:
    steps = _get(results, "peer/wrn", "dat_step_s") or {}
    lines = ["10. Default vs speed options: dat_step, WRN-16-4, 32 px, batch 32, T=10, K=10, "
             "fp32, frozen BN, SGD (interleaved, one process)",
             f"   {'variant':36s}{'median step':>14s}{'vs eager':>12s}"
             f"{'vs original ' + str(PEER_STEP_S) + ' s':>20s}"]
    eager = steps.get("eager")
    for name, label in PEER_VARIANT_LABELS.items():
        if name in steps and eager:
            lines.append(f"   {label:36s}{steps[name]:>12.3f} s{steps[name] / eager:>12.3f}"
                         f"{steps[name] / PEER_STEP_S:>20.3f}")
    for key, what in (("default_vs_old", "channels_last / NCHW"),
                      ("default_vs_eager", "default of a long run / eager two-pass")):
        d = summary.get(key)
        if d:
            lines.append(f"   {what}: {d['value']:.3f} (target <= 0.90){_mark(d)}")
    return lines if eager else lines[:1] + ["   n/a"]


COMPILE_LABELS = {"first": "fresh run (empty caches)",
                  "resumed_without_cache": "restart, no run-dir cache",
                  "resumed_with_cache": "restart, run-dir compile cache"}


def _compile(results: dict, summary: dict, meta: dict) -> List[str]:
    attempts = _get(results, "compile", "attempts") or {}
    label = _get(results, "compile", "label", default="")
    lines = [f"11. model.compile across a restart (loop step, {label}; each attempt a fresh "
             "process with an empty local inductor cache)"]
    for name, label in COMPILE_LABELS.items():
        a = attempts.get(name)
        if a:
            lines.append(
                f"   {label:32s} first step {a['first_step_s']:7.2f} s, then "
                f"{a['steady_step_s']:.3f} s/step; build {a['build_s']:.2f} s; artifacts "
                f"loaded {a['cache_artifacts_loaded']}; graphs {a['graphs_after_first_step']}, "
                f"recompiles after step 1: {a['recompiles_after_first_step']}")
    lines.append("   model.compile: auto's trade (one process; compile = first compiled step - a "
                 "compiled step; saving = eager step - compiled step):")
    for c in COLS:
        b = results.get(f"breakeven/{c}", {})
        if "compile_s" in b:
            steps = b["break_even_steps"]
            lines.append(
                f"   {c:12s} compile {b['compile_s']:6.1f} s; step eager {b['step_s']['eager']:.3f}"
                f" s, compiled {b['step_s']['compiled']:.3f} s; repaid after "
                f"{'never' if steps is None else f'{steps:.0f} steps'}")
    return lines if attempts else lines + ["   n/a"]


def _eval_share(results: dict, summary: dict, meta: dict) -> List[str]:
    lines = ["12. Periodic evaluation's share of wall time at the shipped CIFAR configs' "
             "intervals (estimated: see eval_shares in benchmarks/bench_summary.py)"]
    for row in summary.get("eval_share", []):
        ws2 = row["share_ws2"]
        p = row["parts_h"]
        lines.append(
            f"   {row['config']}: per interval training {row['train_h']:.2f} h, evaluation "
            f"{row['eval_h']:.2f} h (accuracy {p['accuracy']:.2f}, samples {p['samples']:.2f}, "
            f"FID {p['fid']:.2f}); share 1 rank {row['share_ws1']:.1%}, 2 ranks "
            f"{'n/a' if ws2 is None else f'{ws2:.1%}'}")
    return lines if len(lines) > 1 else lines + ["   n/a"]


def _sampling(results: dict, summary: dict, meta: dict) -> List[str]:
    passes = _get(results, "sampling", "passes") or {}
    gemm = _get(results, "sampling", "gemm_gflops")
    lines = ["13. Sample pass (SampleGenerator: seeds + fixed PGD steps on f_y, eager, eval mode) "
             "against the attack roofline (GEMM rate / FLOPs of the steps)"]
    for name, p in passes.items():
        lines.append(
            f"   {name:6s} {p['model']:18s} batch {p['batch']:3d}, {p['steps']} steps: "
            f"{p['images_s']:8.3f} images/s; roofline {p['roofline_images_s']:8.3f} "
            f"({p['attack_step_gflop_per_image']:.2f} GFLOP per image-step at {gemm:.0f} "
            f"GFLOP/s): {p['of_roofline']:.0%} of it")
    return lines if passes else lines + ["   n/a"]


def _prc(results: dict, summary: dict, meta: dict) -> List[str]:
    p = results.get("prc") or {}
    title = "14. Precision/recall's k-NN, sharded over processes (1 thread a process)"
    if "seconds_1rank" not in p:
        return [title, "   n/a"]
    return [title,
            f"   {p['rows_generated']} + {p['rows_real']} {p['dims']}-d rows: 1 process "
            f"{p['seconds_1rank']:.2f} s, 2 processes {p['seconds_2ranks']:.2f} s, ratio "
            f"{p['ratio_2ranks_to_1']:.2f} (target <= 0.6){_mark(summary.get('prc_ratio'))}; "
            f"same values: {p['same_values']}",
            f"   working memory per rank {p['working_mib_1rank']:.0f} / "
            f"{p['working_mib_2ranks']:.0f} MiB (1 / 2 processes), feature rows "
            f"{p['feature_rows_mib']:.0f} MiB"]


def _fused(results: dict, summary: dict, meta: dict) -> List[str]:
    f = results.get("fused/wrn")
    lines = ["15. Both attacks in one pass (fuse_attacks): the two attacks of one micro-batch, "
             "WRN-16-4, 32 px, 32 per stream, T=10, K=10, fp32 (interleaved, one process)"]
    if not f or "attacks_s" not in f:
        return lines + ["   n/a"]
    for mode in ("eager", "compiled"):
        s = f["attacks_s"]
        lines.append(f"   {mode:9s} separate {s[mode + '_separate']:.3f} s, fused "
                     f"{s[mode + '_fused']:.3f} s: ratio {f['fused_over_separate'][mode]:.3f} "
                     f"(paired {f['fused_over_separate_paired'][mode]:.3f})")
    return lines


def _original(results: dict, summary: dict, meta: dict) -> List[str]:
    """16. Against the original DAT code, run side by side (benchmarks/sections/original.py)."""
    r = results.get("original/wrn") or {}
    head = ["16. Against the original DAT code (its step and rebm's, own processes, interleaved)"]
    if "rows" not in r:
        return head + [f"  {r.get('skipped') or r.get('error') or 'not run'}"]
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.original.speed import format_table

    return head + ["  " + line for line in format_table(r).splitlines()]


TABLE_PARTS = (
    _breakdown,
    _each_config("2. DDP efficiency: loop step, same global batch, 2 ranks x 1 thread vs 1 rank "
                 "x 2 threads (gloo)", _ddp_line),
    _each_config("3. Attack step (input gradient only) / training forward+backward (parameter "
                 "gradients)", _attack_line),
    _eval,
    _each_config("5. Resume latency: restore (read_state + load) + build_train_data(start_step=k)"
                 " + first batch", _resume_line),
    _checkpoint,
    _rss,
    _peer,
    _each_config("9. Framework overhead: loop step (dat_step + EMA + AUC + consensus) / minimal "
                 "PyTorch step", _overhead_line),
    _speed_options,
    _compile,
    _eval_share,
    _sampling,
    _prc,
    _fused,
    _original,
)


def table(results: dict, summary: dict, meta: dict) -> str:
    """The printed table: a header, then sections 1-15 (docs/performance.md), then failures."""
    lines = _header(meta)
    for part in TABLE_PARTS:
        lines += ["", *part(results, summary, meta)]
    failed = [k for k, v in results.items() if isinstance(v, dict) and "error" in v]
    if failed:
        lines += ["", "FAILED sections: " + ", ".join(
            f"{k} ({results[k]['error']}, see {results[k]['log']})" for k in failed)]
    return "\n".join(lines)
